# Durable sessions: real fwserve processes on a --session-store dir: directory, killed
# with SIGKILL and restarted on it (tests/integration/crash_test.py, Debian's python3
# with python3-grpcio). include()d from tests/CMakeLists.txt after
# FWSERVE_SYSTEM_PYTHON3 is defined. One ctest test per case; they share a lock so
# that two crash tests never load the machine at once.
function(fwserve_add_crash_test name case)
  add_test(NAME ${name}
           COMMAND ${FWSERVE_SYSTEM_PYTHON3}
                   ${PROJECT_SOURCE_DIR}/tests/integration/crash_test.py
                   --fwserve $<TARGET_FILE:fwserve>
                   --model ${PROJECT_SOURCE_DIR}/models/pretrained/aft-shakespeare
                   --proto-dir ${PROJECT_SOURCE_DIR}/proto
                   CrashTest.${case})
  set_tests_properties(${name} PROPERTIES LABELS integration TIMEOUT 300
                       RESOURCE_LOCK fwserve_crash_tests
                       ENVIRONMENT OMP_NUM_THREADS=1)
endfunction()

fwserve_add_crash_test(crash_kill9_under_load test_kill9_under_load)
fwserve_add_crash_test(crash_loop test_crash_loop)
fwserve_add_crash_test(crash_store_write_failure test_store_write_failure)
