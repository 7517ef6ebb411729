# The LibTorch unit tests, included by tests/CMakeLists.txt (also alone, with
# FWSERVE_MODEL_TESTS_ONLY: scripts/gpu/build.sh on the GPU machine).

# Helpers shared by the LibTorch tests (small random models).
add_library(fwserve_test_util STATIC unit/test_models.cc unit/temp_dir.cc)
target_include_directories(fwserve_test_util PUBLIC ${PROJECT_SOURCE_DIR})
target_compile_options(fwserve_test_util PRIVATE ${FWSERVE_WARNINGS})
target_link_libraries(fwserve_test_util PUBLIC fwserve_models fwserve_training GTest::gtest)
target_precompile_headers(fwserve_test_util REUSE_FROM fwserve_tensor_pch)

# LibTorch unit tests.
add_executable(fwserve_model_tests
  unit/model_equivalence_test.cc
  unit/model_golden_test.cc
  unit/checkpoint_test.cc
  unit/trainer_test.cc
  unit/pretrained_test.cc
  unit/native_step_test.cc
  unit/native_rwkv_test.cc
  unit/graphed_step_test.cc
  unit/batch_sampler_test.cc
  unit/rwkv_test.cc
  unit/delta_net_test.cc
  unit/gpu_bodies_test.cc
  unit/gpu_row_copy_test.cc
  unit/gpu_gemv_test.cc
  unit/gpu_sample_test.cc
  unit/model_kernel_path_test.cc
  unit/gpu_aft_test.cc
  unit/gpu_linear_attention_test.cc
  unit/gpu_fast_weight_test.cc
)
# The CUDA equivalence cases only where this LibTorch has CUDA: on a CPU LibTorch they
# could only skip, and under CI a skipped test fails the run (scripts/test.sh).
option(FWSERVE_CUDA_TESTS "Build the CUDA equivalence tests even without a CUDA LibTorch" OFF)
if(TORCH_CUDA_LIBRARIES OR FWSERVE_CUDA_TESTS)
  target_sources(fwserve_model_tests PRIVATE unit/model_cuda_test.cc)
  # gpu_sample_test.cc's GPU case (the sampling kernel against its mirror), built here only.
  set_source_files_properties(unit/gpu_sample_test.cc PROPERTIES COMPILE_DEFINITIONS
                              FWSERVE_CUDA_TESTS SKIP_PRECOMPILE_HEADERS ON)
  # gpu_aft_test.cc's GPU case (the aft mixer on CUDA, its fused kernel, against the mirror).
  set_source_files_properties(unit/gpu_aft_test.cc PROPERTIES COMPILE_DEFINITIONS
                              FWSERVE_CUDA_TESTS SKIP_PRECOMPILE_HEADERS ON)
  set_source_files_properties(unit/gpu_linear_attention_test.cc PROPERTIES COMPILE_DEFINITIONS
                              FWSERVE_CUDA_TESTS SKIP_PRECOMPILE_HEADERS ON)
  set_source_files_properties(unit/gpu_fast_weight_test.cc PROPERTIES COMPILE_DEFINITIONS
                              FWSERVE_CUDA_TESTS SKIP_PRECOMPILE_HEADERS ON)
  message(STATUS "fwserve: CUDA equivalence tests built (LibTorch has CUDA)")
endif()
# gpu_row_copy_test.cc's GPU case (the row-copy kernels and State::Gather / Scatter on
# CUDA), where models/gpu built the kernels (it links them).
get_target_property(fwserve_row_copy_kernels_type fwserve_gpu_kernels TYPE)
if(TORCH_CUDA_LIBRARIES AND fwserve_row_copy_kernels_type STREQUAL "STATIC_LIBRARY")
  set_source_files_properties(unit/gpu_row_copy_test.cc PROPERTIES COMPILE_DEFINITIONS
                              FWSERVE_CUDA_TESTS SKIP_PRECOMPILE_HEADERS ON
                              SKIP_UNITY_BUILD_INCLUSION ON)
endif()
target_compile_options(fwserve_model_tests PRIVATE ${FWSERVE_WARNINGS})
# The GPU kernels' bodies (models/gpu) vectorise their loops with `#pragma omp simd`.
set_source_files_properties(unit/gpu_bodies_test.cc PROPERTIES COMPILE_OPTIONS -fopenmp-simd)
set_source_files_properties(unit/gpu_linear_attention_test.cc PROPERTIES COMPILE_OPTIONS
                            -fopenmp-simd)
set_source_files_properties(unit/gpu_fast_weight_test.cc PROPERTIES COMPILE_OPTIONS -fopenmp-simd)
# The sampling kernel's mirror test alone, out of the unity units.
set_source_files_properties(unit/gpu_sample_test.cc PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
target_link_libraries(fwserve_model_tests PRIVATE fwserve_test_util GTest::gtest_main)
target_precompile_headers(fwserve_model_tests REUSE_FROM fwserve_tensor_pch)
# Debian's python3 runs tools/convert_rwkv_cpp.py (standard library only) in rwkv_test.cc.
find_program(FWSERVE_MODEL_TESTS_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH REQUIRED)
target_compile_definitions(fwserve_model_tests PRIVATE
  FWSERVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}" FWSERVE_PYTHON3="${FWSERVE_MODEL_TESTS_PYTHON3}")
gtest_discover_tests(fwserve_model_tests DISCOVERY_TIMEOUT 120
                     PROPERTIES LABELS unit ENVIRONMENT OMP_NUM_THREADS=1)

# The serving core's LibTorch pieces that need no server (StatePool, Runner,
# SessionKeeper; the shared store's semantics over the in-memory fake).
add_executable(fwserve_core_tests unit/state_pool_test.cc
               unit/session_keeper_test.cc common/fake_shared_store.cc)
target_compile_options(fwserve_core_tests PRIVATE ${FWSERVE_WARNINGS})
target_link_libraries(fwserve_core_tests PRIVATE fwserve_engine fwserve_test_util GTest::gtest_main)
target_precompile_headers(fwserve_core_tests REUSE_FROM fwserve_tensor_pch)
gtest_discover_tests(fwserve_core_tests DISCOVERY_TIMEOUT 120
                     PROPERTIES LABELS unit ENVIRONMENT OMP_NUM_THREADS=1)
# Unity builds (fwserve_unity_build, the top CMakeLists.txt): four files a unit.
fwserve_unity_build(fwserve_model_tests 4)
fwserve_unity_build(fwserve_core_tests 4)
