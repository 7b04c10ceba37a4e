"""The optimizer and its schedule: LANS and LAMB (``lans``: the optimizer classes and the per-tensor step),
the implementations of their element-wise work (``backends``) and the kernels those run (``elementwise``:
torch code, compiled or eager; ``cpu_ext``: the C++ CPU kernels in ``csrc/``), where each tensor lies in
DeepSpeed's flat ZeRO partitions (``zero_map``), the optimizer a run config names and its parameter groups
(``factory``), and the learning-rate schedules (``schedules``)."""
