"""One-off studies: scripts that answered a design question once (their result pages in docs/results say
which). They are kept runnable (``python -m tools.<name>`` from the repository root) but are not part of
the benchmark suite, the GPU check or any goal; benchmarks/ holds the measurements that are repeated."""
