# ctest client_package_consumer: installs the "client" component of the build tree into
# a temporary prefix, then configures, builds and runs tests/client/consumer against it
# with find_package(fwserve). Arguments (-D): BUILD_DIR, SOURCE_DIR, WORK_DIR,
# GENERATOR, LAUNCHER (optional compiler launcher, e.g. ccache), CXX_COMPILER.
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "consumer_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "failed (${result}): ${command}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}" --component client)

# What the package must contain.
foreach(file include/fwserve/client/client.h include/fwserve/fwserve/v1/fwserve.pb.h
             include/fwserve/fwserve/v1/fwserve.grpc.pb.h
             include/fwserve/grpc/health/v1/health.grpc.pb.h
             lib/libfwserve_client.a lib/libfwserve_proto.a
             lib/cmake/fwserve/fwserveConfig.cmake lib/cmake/fwserve/fwserveConfigVersion.cmake
             lib/cmake/fwserve/fwserveTargets.cmake bin/fwctl
             share/fwserve/proto/fwserve/v1/fwserve.proto)
  if(NOT EXISTS "${prefix}/${file}")
    message(FATAL_ERROR "the installed package lacks ${file}")
  endif()
endforeach()

set(configure ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
if(LAUNCHER)
  list(APPEND configure -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
run(${configure})
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2)
run("${WORK_DIR}/build/consumer")
