"""The largest job the planner and the launcher take: beyond any cluster (4096 nodes of 8 GPUs are
32k GPUs), and it keeps every layout search and node list short."""

MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
