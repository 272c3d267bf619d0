# Runs the start-up memory bound of startup_memory_check.cc: writes the
# checkpoint in one process, starts from it at 1 and at 2 ranks in fresh
# processes (each rank checks its own peak RSS), and removes the checkpoint
# whatever happened. Every step has a time limit, so the removal runs even when
# a step hangs.
#   cmake -DTOOL=<startup_memory_check> -DMPIEXEC=<mpirun> -DDIR=<scratch dir>
#         -P startup_memory.cmake
file(REMOVE_RECURSE "${DIR}")
set(failures "")
execute_process(COMMAND ${TOOL} generate ${DIR} RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc STREQUAL "0")
  list(APPEND failures "generate: ${rc}")
else()
  foreach(ranks 1 2)
    execute_process(COMMAND ${MPIEXEC} -np ${ranks} --oversubscribe ${TOOL} check ${DIR}
                    RESULT_VARIABLE rc TIMEOUT 120)
    if(NOT rc STREQUAL "0")
      list(APPEND failures "check at ${ranks} ranks: ${rc}")
    endif()
  endforeach()
endif()
file(REMOVE_RECURSE "${DIR}")
if(failures)
  message(FATAL_ERROR "start-up memory: ${failures}")
endif()
