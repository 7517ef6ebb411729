# Several fwserve replicas on one Redis session store (--session-store redis://),
# behind HAProxy with the shipped deploy/haproxy/haproxy.cfg: real redis-server,
# haproxy and fwserve processes (tests/integration/replicas_test.py, Debian's python3
# with python3-grpcio). include()d from tests/CMakeLists.txt after
# FWSERVE_SYSTEM_PYTHON3 is defined. One ctest test per case; they take the crash
# tests' lock so that no two of these process-heavy tests load the machine at once.
function(fwserve_add_replicas_test name case)
  add_test(NAME ${name}
           COMMAND ${FWSERVE_SYSTEM_PYTHON3}
                   ${PROJECT_SOURCE_DIR}/tests/integration/replicas_test.py
                   --fwserve $<TARGET_FILE:fwserve>
                   --model ${PROJECT_SOURCE_DIR}/models/pretrained/aft-shakespeare
                   --proto-dir ${PROJECT_SOURCE_DIR}/proto
                   --haproxy-config ${PROJECT_SOURCE_DIR}/deploy/haproxy/haproxy.cfg
                   ReplicasTest.${case})
  set_tests_properties(${name} PROPERTIES LABELS integration TIMEOUT 300
                       RESOURCE_LOCK fwserve_crash_tests
                       ENVIRONMENT OMP_NUM_THREADS=1)
endfunction()

fwserve_add_replicas_test(replicas_hopping_conversation test_hopping_conversation)
fwserve_add_replicas_test(replicas_replica_crash test_replica_crash)
fwserve_add_replicas_test(replicas_fencing test_fencing)
fwserve_add_replicas_test(replicas_redis_restart test_redis_restart)
fwserve_add_replicas_test(replicas_redis_down test_redis_down)
