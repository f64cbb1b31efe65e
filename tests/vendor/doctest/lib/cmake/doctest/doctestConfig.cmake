# doctest 2.4.9's header as a CMake package, for machines without a doctest package (Meson's
# dependency('doctest', method: 'cmake') finds it through -Dcmake_prefix_path=tests/vendor/doctest;
# scripts/gpu_check.sh passes that).
if(NOT TARGET doctest::doctest)
  get_filename_component(_doctest_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  add_library(doctest::doctest INTERFACE IMPORTED)
  set_target_properties(doctest::doctest PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_doctest_prefix}/include")
  unset(_doctest_prefix)
endif()
