/* libcuda.so.1 for a machine without an NVIDIA driver: enough for TransformerEngine's prebuilt
 * library to load, so that its pure-JAX path can run on a CPU as te_flax's parity reference.
 *
 * libtransformer_engine.so (transformer-engine-cu12) links cuDNN's runtime-compiled engines,
 * which link the driver, and Python loads it with RTLD_NOW: every driver symbol those libraries
 * import must resolve. None is called on the pure-JAX path (NVTE_JAX_CUSTOM_CALLS=false,
 * JAX_PLATFORMS=cpu); should one be, it fails with CUDA_ERROR_STUB_LIBRARY, as the CUDA
 * toolkit's own stub library does.
 */
typedef int CUresult;
enum { kStubLibrary = 34 };

#define FAILS(symbol) \
  CUresult symbol(void) { return kStubLibrary; }

CUresult cuGetErrorString(CUresult code, const char **text) {
  (void)code;
  if (text) *text = "no NVIDIA driver on this machine (CUDA driver stub)";
  return kStubLibrary;
}

CUresult cuGetErrorName(CUresult code, const char **text) {
  (void)code;
  if (text) *text = "CUDA_ERROR_STUB_LIBRARY";
  return kStubLibrary;
}

/* imported by cuDNN's runtime-compiled engines */
FAILS(cuModuleGetFunction)
FAILS(cuModuleLoadData)
FAILS(cuModuleUnload)
FAILS(cuTensorMapEncodeIm2col)
FAILS(cuTensorMapEncodeTiled)
/* imported by TE's expert-parallel NCCL library, shipped beside it */
FAILS(cuCtxGetCurrent)
FAILS(cuFuncSetAttribute)
FAILS(cuInit)
FAILS(cuLaunchKernel)
FAILS(cuLaunchKernelEx)
FAILS(cuModuleLoadDataEx)
