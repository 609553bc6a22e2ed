"""One module per model family, each registering a `stageserve.device.model.family.Family`; every module here is loaded."""
