"""Layout-independent checkpoints on torch.distributed.checkpoint."""
