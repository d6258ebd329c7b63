"""The streaming engine: options, the decode loop, streaming MoE blocks, slot pool, store, layout,
prerouter heads and staging, LoRA."""
