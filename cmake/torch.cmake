# LibTorch from the torch Python package of MEMBAR_PYTHON, without find_package(Torch): the
# PyPI wheel's CMake config insists on a CUDA toolkit matching its build, which a CPU-only
# machine need not have. We need only headers, the libraries and the ABI flag.
#
# Note [Which torch a pip build links]
#   Rationale: _C.so must link the very torch it will be imported with (the C++ ABI of torch's
#   libraries changes with every release, and a CUDA build of torch differs from a CPU one). A
#   build requirement `torch` would make pip download a second torch into its isolated build
#   environment (gigabytes, and possibly another version than the one installed); a pinned one
#   would force every user onto our version.
#   Approach: pyproject.toml requires only scikit-build-core; pip runs the build with the target
#   environment's interpreter, hiding that environment's site-packages through PYTHONPATH (a
#   sitecustomize of its own) and PYTHONNOUSERSITE. Under scikit-build-core (SKBUILD) we ask
#   that same interpreter for torch with both variables removed, so it answers from the
#   environment the package installs into. `pip install --no-build-isolation .` gets the same
#   answer without the detour.
#   Limitations: frontends that build in a fresh virtual environment of their own (python -m
#   build, uv) have no torch there: the error below then says to build without isolation, or to
#   name the interpreter (-Ccmake.define.MEMBAR_PYTHON=/path/to/python).
set(_membar_python_command ${MEMBAR_PYTHON})
if(SKBUILD)
  set(_membar_python_command ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE ${MEMBAR_PYTHON})
endif()
execute_process(
  COMMAND ${_membar_python_command} -c "import torch, os, sys; from torch.utils import cpp_extension as c; print(','.join(c.include_paths())); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__); import sysconfig; print(sysconfig.get_paths()['include']); print(int(torch.cuda.is_available() or torch.version.cuda is not None))"
  OUTPUT_VARIABLE _membar_torch_info
  RESULT_VARIABLE _membar_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _membar_torch_rc EQUAL 0 AND SKBUILD)
  message(FATAL_ERROR "membar builds against the torch of the environment it installs into, and "
                      "'${MEMBAR_PYTHON} -c \"import torch\"' failed there. Install torch first; with a "
                      "frontend that builds in an environment of its own (python -m build, uv), build without "
                      "isolation (pip install --no-build-isolation .) or pass "
                      "-Ccmake.define.MEMBAR_PYTHON=/path/to/python-with-torch.")
elseif(NOT _membar_torch_rc EQUAL 0)
  message(FATAL_ERROR "MEMBAR_WITH_TORCH=ON but '${MEMBAR_PYTHON} -c \"import torch\"' failed. "
                      "Run 'make setup' (creates .venv with torch) or pass -DMEMBAR_WITH_TORCH=OFF.")
endif()
string(REPLACE "\n" ";" _membar_torch_lines "${_membar_torch_info}")
list(GET _membar_torch_lines 0 _incs)
list(GET _membar_torch_lines 1 MEMBAR_TORCH_LIB_DIR)
list(GET _membar_torch_lines 2 MEMBAR_TORCH_CXX11_ABI)
list(GET _membar_torch_lines 3 MEMBAR_TORCH_VERSION)
list(GET _membar_torch_lines 4 MEMBAR_PYTHON_INCLUDE)
string(REPLACE "," ";" MEMBAR_TORCH_INCLUDE_DIRS "${_incs}")
message(STATUS "LibTorch ${MEMBAR_TORCH_VERSION} from ${MEMBAR_TORCH_LIB_DIR} (cxx11 abi ${MEMBAR_TORCH_CXX11_ABI})")
add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${MEMBAR_TORCH_CXX11_ABI})

add_library(membar_torch INTERFACE)
target_include_directories(membar_torch SYSTEM INTERFACE ${MEMBAR_TORCH_INCLUDE_DIRS} ${MEMBAR_PYTHON_INCLUDE})
target_link_directories(membar_torch INTERFACE ${MEMBAR_TORCH_LIB_DIR})
target_link_libraries(membar_torch INTERFACE torch torch_cpu c10)
if(MEMBAR_WITH_CUDA)
  target_link_libraries(membar_torch INTERFACE torch_cuda c10_cuda CUDA::cudart)
  target_compile_definitions(membar_torch INTERFACE USE_C10D_NCCL=0)
endif()
