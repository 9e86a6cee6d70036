"""Bases and increments: their on-disk format and the offline rules (no trainer involved).

A base is a torch.distributed.checkpoint (DCP) directory of the model and its optimizers; an
increment holds, per rank, the rows changed since the previous one. :mod:`.format` owns the
layout and the stored entries, :mod:`.chain` which base and increments a restore uses. Taking
them and restoring a model is the trainer's (:mod:`persistent_delta.trainer.increments`).
"""
