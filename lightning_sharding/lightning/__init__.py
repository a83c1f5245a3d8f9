"""The Lightning glue: the DataModule, the callbacks, and the accounting that ties the ledger to
the optimizer steps the weights hold."""
