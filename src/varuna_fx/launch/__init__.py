"""Command line and process launching: ``varuna-fx``, torchrun, elastic agents."""
