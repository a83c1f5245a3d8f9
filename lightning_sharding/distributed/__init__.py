"""Talking across ranks without Lightning: object gathers over ``torch.distributed`` and the one
agreement every rank checks at setup."""
