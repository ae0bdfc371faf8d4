"""Gradient and optimizer synchronisation across replicas: the gradient all-reduce
(``grad_sync``), slow-link replica sync with compression and PowerSGD (``replica_sync``),
DiLoCo's outer step (``diloco``) and ZeRO-1 sharded optimizer state (``zero``,
``zero_repoint``)."""
