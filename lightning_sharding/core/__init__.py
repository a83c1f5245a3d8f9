"""The pure core: manifest -> epoch order -> plan -> ledger, over a world of ranks and workers.

Plain functions and small types of integers and NumPy arrays. Nothing here imports torch or
Lightning, or knows about a feature such as mixtures: a mixture is an ``Order`` the planner takes.
"""
