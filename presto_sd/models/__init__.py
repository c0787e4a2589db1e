"""Models: loading targets and drafters, the DFlash model, drafter assets."""
