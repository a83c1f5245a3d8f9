"""Talking across ranks without Lightning: object gathers and broadcasts over ``torch.distributed``."""
