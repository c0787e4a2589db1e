"""The in-process engines (DFlashDrafter, HFVerifier) and the embedded stack."""
