"""Test-suite setup. Its presence puts ``tests/`` on ``sys.path`` (pytest's prepend import mode) before any test
module is collected, so tests in sub-folders import the shared helpers of this folder (``hf_reference``,
``test_train_e2e``'s launch helpers) whatever order pytest collects them in."""

from shared_runs import everyday_runs, reliability_reference  # noqa: E402,F401  (session fixtures several modules share)
