"""``ssmq bench``: latency, throughput, serving load, kernel and accuracy benchmarks.

Every benchmark times with one helper (``timing.time_fn``: CUDA events on a GPU, ``perf_counter`` on the CPU, warm-up
runs, optional L2 flush) and writes ``<name>.json`` (rows plus the command, device, date and versions) and a PNG to
``--out``. Numbers measured on the CPU exercise the plumbing only; speed is measured on a GPU.
"""
