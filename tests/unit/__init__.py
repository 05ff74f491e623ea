"""In-process tests: no process group, neither in the pytest process nor spawned. A test that
needs one (tests.spawn.run_distributed, or a Trainer, which builds a gloo group even on one rank)
lives in tests/multiprocess/, in a file of the same name where the topic allows; a CLI run
through ``subprocess`` that exits before any process group starts may stay here."""
