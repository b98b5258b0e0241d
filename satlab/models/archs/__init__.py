"""The architectures, one module each: importing this package imports every module in it, and each registers itself
(:func:`satlab.models.architecture.register`)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
