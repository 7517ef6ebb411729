# Run by the fuzz_sanitizer_build test (cmake -P): configures the project with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer (every report fatal) and libFuzzer's
# coverage instrumentation (fuzzer-no-link: no main is linked in; the fuzz_<name>
# binaries of tests/fuzz/CMakeLists.txt link it) in BINARY_DIR and builds only the fuzz
# targets TARGETS. Usage:
#   cmake -DSOURCE_DIR=... -DBINARY_DIR=... -DCLANGXX=clang++ -DTARGETS="a;b" -P sanitized_build.cmake
foreach(var SOURCE_DIR BINARY_DIR CLANGXX TARGETS)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "sanitized_build.cmake: ${var} is not set")
  endif()
endforeach()
set(flags "-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer")
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BINARY_DIR} -G Ninja
          -DCMAKE_CXX_COMPILER=${CLANGXX} -DCMAKE_BUILD_TYPE=RelWithDebInfo
          -DFWSERVE_BUILD_BENCH=OFF -DFWSERVE_FUZZ_SANITIZED_BUILD=ON
          "-DCMAKE_CXX_FLAGS=${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}"
  OUTPUT_QUIET COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BINARY_DIR} --target ${TARGETS}
                COMMAND_ERROR_IS_FATAL ANY)
