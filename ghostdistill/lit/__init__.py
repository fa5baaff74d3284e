"""The Lightning layer: the LightningModule (`module`), the DataModule (`datamodule`) and the callbacks
that calibrate before any step and write the report (`callbacks`)."""
