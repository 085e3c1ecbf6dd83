"""torch_xla.test mirrors: test_utils (training/test progress lines, summaries, mp_test)."""
