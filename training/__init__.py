"""Training: the loop (``trainer``, ``clock``, ``logbook``, ``evaluate``, ``watch``), its configuration
(``config``), the start of a run (``build``: data, model, engine; ``engine``, ``zero_init``, ``devices``,
``collectives``: DeepSpeed, the device and the process group), the run's numbers and events (``metrics``,
``events``), and two rooms: ``checkpoint/`` (saving, resuming, exporting) and ``optim/`` (LANS/LAMB, the
optimizer factory, ZeRO layouts, schedules)."""
