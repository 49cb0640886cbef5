"""CPU stand-in for SGLang's CUDA kernel package ``sgl_kernel`` (see ``pd_disagg.sglang_cpu``)."""

from pd_disagg.sglang_cpu.stub import install

__version__ = "0.0.0+pd-cpu-stand-in"
__getattr__ = install(__name__)
