"""CPU stand-in for ``torchvision``, which SGLang imports for vision models only (see ``pd_disagg.sglang_cpu``)."""

from pd_disagg.sglang_cpu.stub import install

__version__ = "0.0.0+pd-cpu-stand-in"
__getattr__ = install(__name__)
