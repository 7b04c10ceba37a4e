"""Checkpoints: where they are kept and how a tag is committed (``storage``), how a rank writes its part in the
foreground or the background (``saving``), which checkpoint a run continues from and whether it may
(``resume``), the trainer's ``Checkpointer`` (when to save, and restore), loads that run no code
(``safeload``), the replicas' agreement at the end of a run (``replicas``) and the export of a checkpoint to a
Hugging Face directory (``export``)."""
