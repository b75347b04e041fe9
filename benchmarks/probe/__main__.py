"""``python -m benchmarks.probe MODE [options]``: see benchmarks.probe."""

from benchmarks.probe import (
    across_rejections,
    coupling,
    delayed_link,
    drafter_host,
    lost_stage_node,
    prefill,
    prefix_reuse,
    restart_cost,
    sequence_batch,
    serve_overhead,
    transport_hop,
    where_time_goes,
)
from benchmarks.probe.harness import main

REGISTERED = (where_time_goes, restart_cost, sequence_batch, transport_hop, serve_overhead, delayed_link, prefill,
              prefix_reuse, drafter_host, coupling, across_rejections, lost_stage_node)
"""Each module registers its mode with the harness when it is imported."""

if __name__ == "__main__":  # not when a spawned child process imports this as __mp_main__
    main()
