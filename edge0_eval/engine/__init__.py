"""The streaming engine: options, the decode step, streaming MoE blocks, slot pool, store,
prerouter heads and staging, LoRA. The files it reads are edge0_eval.formats'."""
