"""How a batch is cut into pieces that fit, and the one retry loop that runs them.

- `data`: the input as Keras takes it, as chunks of rows;
- `planner`: the next piece size, learned from OOMs and the device's memory;
- `knowledge`: what the planner keeps per model between calls, and its `Event`s;
- `shape_plan`: sizes from the analytic estimate where each shape compiles;
- `replica_memory`: the memory of the devices a piece runs on;
- `runner`: `run_in_pieces`, the one retry loop.
"""
