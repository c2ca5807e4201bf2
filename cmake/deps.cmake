# Third-party libraries of the daemon and client: libuv, spdlog (+ fmt), Boost (headers only).
# Found as system packages (Debian: libuv1-dev, libspdlog-dev, libboost-dev); on a machine without
# them (the GPU machine has no network), from a bundle made by tools/make_gpu_deps.sh and passed as
# -DMEMBAR_DEPS_PREFIX=<dir> (include/, lib/). Defines membar::uv, membar::spdlog, membar::boost.
set(MEMBAR_DEPS_PREFIX "" CACHE PATH "Prefix of a bundled include/ + lib/ for libuv, spdlog, fmt, boost")
if(MEMBAR_DEPS_PREFIX)
  list(PREPEND CMAKE_PREFIX_PATH ${MEMBAR_DEPS_PREFIX})
endif()

if(NOT TARGET membar::uv)
  find_path(MEMBAR_UV_INCLUDE uv.h HINTS ${MEMBAR_DEPS_PREFIX}/include)
  find_library(MEMBAR_UV_LIBRARY NAMES uv uv_a HINTS ${MEMBAR_DEPS_PREFIX}/lib)
  if(NOT MEMBAR_UV_INCLUDE OR NOT MEMBAR_UV_LIBRARY)
    message(FATAL_ERROR "libuv not found: install libuv1-dev (tools/setup.sh does) or pass -DMEMBAR_DEPS_PREFIX")
  endif()
  add_library(membar::uv INTERFACE IMPORTED GLOBAL)
  target_include_directories(membar::uv INTERFACE ${MEMBAR_UV_INCLUDE})
  target_link_libraries(membar::uv INTERFACE ${MEMBAR_UV_LIBRARY} Threads::Threads ${CMAKE_DL_LIBS})

  find_package(spdlog QUIET)
  add_library(membar::spdlog INTERFACE IMPORTED GLOBAL)
  if(spdlog_FOUND)
    target_link_libraries(membar::spdlog INTERFACE spdlog::spdlog)
  else()
    # Header-only spdlog over header-only fmt.
    find_path(MEMBAR_SPDLOG_INCLUDE spdlog/spdlog.h HINTS ${MEMBAR_DEPS_PREFIX}/include)
    if(NOT MEMBAR_SPDLOG_INCLUDE)
      message(FATAL_ERROR "spdlog not found: install libspdlog-dev (tools/setup.sh does) or pass -DMEMBAR_DEPS_PREFIX")
    endif()
    target_include_directories(membar::spdlog INTERFACE ${MEMBAR_SPDLOG_INCLUDE})
    target_compile_definitions(membar::spdlog INTERFACE SPDLOG_HEADER_ONLY SPDLOG_FMT_EXTERNAL FMT_HEADER_ONLY)
  endif()

  find_path(MEMBAR_BOOST_INCLUDE boost/interprocess/managed_shared_memory.hpp HINTS ${MEMBAR_DEPS_PREFIX}/include)
  if(NOT MEMBAR_BOOST_INCLUDE)
    message(FATAL_ERROR "Boost.Interprocess not found: install libboost-dev (tools/setup.sh does) or pass -DMEMBAR_DEPS_PREFIX")
  endif()
  add_library(membar::boost INTERFACE IMPORTED GLOBAL)
  target_include_directories(membar::boost SYSTEM INTERFACE ${MEMBAR_BOOST_INCLUDE})
  target_link_libraries(membar::boost INTERFACE rt)
endif()
