# Runs CMD (a ;-list, typically `mpirun -np N abort_demo ...`) and checks that
# the job failed the way a failing rank must end it: a non-zero exit (mpirun
# passes on the MPI_Abort code, or another non-zero one: any counts), within
# MAX_SECONDS (a hang is the failure this guards against), with output matching
# EXPECT_REGEX exactly once (the reason is printed once, not by every rank).
# Optionally, MARK_REGEX with one capture group matching a Unix time in the
# output (when the fault struck) and MAX_SECONDS_AFTER_MARK: the job must also
# have ended within that many seconds of the mark.
#   cmake -DCMD=... -DMAX_SECONDS=30 -DEXPECT_REGEX=... -P expect_abort.cmake
string(TIMESTAMP start_s "%s" UTC)
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${MAX_SECONDS})
string(TIMESTAMP end_s "%s" UTC)
math(EXPR elapsed_s "${end_s} - ${start_s}")
set(all "${out}${err}")

if(rc MATCHES "timeout")
  message(FATAL_ERROR "still running after ${MAX_SECONDS} s: the failure did not end the job\n${all}")
endif()
if("${rc}" STREQUAL "0")
  message(FATAL_ERROR "exit code 0, expected a failure; output:\n${all}")
endif()
if(elapsed_s GREATER_EQUAL MAX_SECONDS)
  message(FATAL_ERROR "took ${elapsed_s} s, limit ${MAX_SECONDS} s; output:\n${all}")
endif()
# Matches are counted as a list: a ';' in the text would split one into two.
string(REPLACE ";" "<semicolon>" all_escaped "${all}")
string(REPLACE ";" "<semicolon>" regex_escaped "${EXPECT_REGEX}")
string(REGEX MATCHALL "${regex_escaped}" matches "${all_escaped}")
list(LENGTH matches num_matches)
if(NOT num_matches EQUAL 1)
  message(FATAL_ERROR "output matches '${EXPECT_REGEX}' ${num_matches} times, expected once:\n${all}")
endif()
if(DEFINED MARK_REGEX)
  if(NOT all MATCHES "${MARK_REGEX}")
    message(FATAL_ERROR "output does not match the mark '${MARK_REGEX}':\n${all}")
  endif()
  math(EXPR after_mark_s "${end_s} - ${CMAKE_MATCH_1}")
  if(after_mark_s GREATER MAX_SECONDS_AFTER_MARK)
    message(FATAL_ERROR "ended ${after_mark_s} s after the mark, limit ${MAX_SECONDS_AFTER_MARK} s:\n${all}")
  endif()
  set(elapsed_s "${elapsed_s} (${after_mark_s} after the mark)")
endif()
message(STATUS "ok: exit ${rc} after ${elapsed_s} s; output:\n${all}")
