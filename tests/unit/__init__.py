"""In-process tests: no process group spawned, no launcher subprocess. A file with a few
multi-process tests sits here when most of its tests are in-process."""
