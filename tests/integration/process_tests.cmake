# Process-level tests in Python (Debian's python3 with python3-grpcio): real fwserve
# processes, and real redis-server and haproxy where a case needs them, started on
# free loopback ports and stopped at the end. include()d from tests/CMakeLists.txt
# after FWSERVE_SYSTEM_PYTHON3 is defined. One ctest test per case; they share a lock
# so that no two of these process-heavy tests load the machine at once.
#   crash_test.py     durable sessions survive kill -9 (--session-store dir:)
#   replicas_test.py  several replicas on one Redis behind HAProxy (redis://)
#   api_keys_test.py  API keys on the real binary (SIGHUP, warnings, log hygiene)
#   http_durable_test.py  previous_response_id across a restart (dir:) and replicas (redis://)
function(fwserve_add_process_test name script case)
  add_test(NAME ${name}
           COMMAND ${FWSERVE_SYSTEM_PYTHON3} ${PROJECT_SOURCE_DIR}/tests/integration/${script}
                   --fwserve $<TARGET_FILE:fwserve>
                   --model ${PROJECT_SOURCE_DIR}/models/pretrained/aft-shakespeare
                   --proto-dir ${PROJECT_SOURCE_DIR}/proto ${ARGN} ${case})
  set_tests_properties(${name} PROPERTIES LABELS integration TIMEOUT 300
                       RESOURCE_LOCK fwserve_process_tests
                       ENVIRONMENT OMP_NUM_THREADS=1)
endfunction()

fwserve_add_process_test(crash_kill9_under_load crash_test.py CrashTest.test_kill9_under_load)
fwserve_add_process_test(crash_loop crash_test.py CrashTest.test_crash_loop)
fwserve_add_process_test(crash_store_write_failure crash_test.py
                         CrashTest.test_store_write_failure)

set(_haproxy --haproxy-config ${PROJECT_SOURCE_DIR}/deploy/haproxy/haproxy.cfg)
foreach(case hopping_conversation replica_crash fencing redis_restart redis_down)
  fwserve_add_process_test(replicas_${case} replicas_test.py ReplicasTest.test_${case}
                           ${_haproxy})
endforeach()

# api_keys_test.py: --api-keys-file on the real binary (SIGHUP reload, the open-listen
# warning, log hygiene).
foreach(case sighup_revokes_a_key open_listen_warns log_lines_are_safe)
  fwserve_add_process_test(api_keys_${case} api_keys_test.py ApiKeysTest.test_${case})
endforeach()

# http_durable_test.py: POST /v1/responses with previous_response_id continues exactly
# after a SIGTERM restart and a kill -9 on a dir: store, and across two replicas on one
# Redis; store: false leaves no session. About 5 s each.
foreach(case dir_restart dir_kill9 redis_replicas)
  fwserve_add_process_test(http_durable_${case} http_durable_test.py
                           HttpDurableTest.test_${case})
  set_tests_properties(http_durable_${case} PROPERTIES TIMEOUT 120)
endforeach()

# Documented promises proven on the real binary (issue 28), one file per group; each
# file registers its own cases with fwserve_add_process_test.
include(${CMAKE_CURRENT_LIST_DIR}/promises_tenancy_tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/promises_flags_tests.cmake)
