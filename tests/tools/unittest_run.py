"""The end of a process-level Python test run (crash_test.py, replicas_test.py): logs
of the failed tests, the work directories kept or removed, a one-line count, and the
exit status."""
import shutil
import sys


def report_and_exit(name, result, work_dirs, keep, show_failure):
    """`result`: a unittest result; `show_failure(test_id)` writes that test's process
    logs to stderr; `keep`: keep `work_dirs` (for debugging) instead of removing them."""
    failed = len(result.failures) + len(result.errors)
    for test, _ in result.failures + result.errors:
        show_failure(test.id())
    if keep:
        print("%s: work directories kept: %s" % (name, " ".join(work_dirs)))
    else:
        for work in work_dirs:
            shutil.rmtree(work, ignore_errors=True)
    print("%d passed, %d failed" % (result.testsRun - failed - len(result.skipped), failed))
    sys.exit(0 if result.wasSuccessful() else 1)


def check(condition, message):
    """An assertion that `python3 -O` (PYTHONOPTIMIZE) cannot strip, unlike `assert`."""
    if not condition:
        raise AssertionError(message)
