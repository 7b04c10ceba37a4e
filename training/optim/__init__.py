"""The optimizer and its schedule: LANS and LAMB with their kernels (``lans``, the C++ CPU kernels in
``csrc/``), where each tensor lies in DeepSpeed's flat ZeRO partitions (``zero_map``), the optimizer a run
config names and its parameter groups (``factory``), and the learning-rate schedules (``schedules``)."""
