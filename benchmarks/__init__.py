"""The benchmarks, a package so that its scripts share code by import.

Entry scripts (``python benchmarks/<script>.py`` or ``python -m benchmarks.<script>``):
``compare`` (offline, side by side), ``serve_bench`` (the server under load levels),
``load_test`` (load, faults and bad input; exact under load), ``replay``, ``models``.
Their parts: ``plan`` (the method grids, which engines to start), ``offline`` (running a
plan's engines), ``worker`` (one engine in its process), ``processes`` (starting,
stopping and interleaving engine processes and servers), ``host`` (the machine: dtype
fallback, recorded environment), ``report`` (figures, schema, tables, plots), ``load``
(the load test's calls, faults and checks), ``serve_client`` (streamed requests, server metrics).
"""
