/* A stand-in for libcuda.so.1 on machines without a GPU: the driver-API calls Cuvil's launcher
 * makes, each checking its arguments, and every cuLaunchKernel recorded. The parameter area is
 * built as the driver builds it, from the layout the test gives (the cubin's own offsets and
 * sizes), so the test reads back exactly the bytes a kernel would see.
 * Build: gcc -shared -fPIC -o libcuda.so.1 mock_libcuda.c */
#include <string.h>

typedef int CUresult;
static char module_token, function_token;
static int param_count, param_sizes[64], param_offsets[64], area_size, launch_count;
static unsigned char area[4096];
static unsigned launch_dims[7];
static void *launch_stream;
static char loaded_symbol[256];
static int shared_attribute;

CUresult cuInit(unsigned flags) { return flags ? 1 : 0; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuGetErrorString(CUresult status, const char **text) {
  *text = status == 500 ? "named symbol not found" : "mock error";
  return 0;
}
static char context_token;
static void *current_context;
static int context_retains;
CUresult cuCtxGetCurrent(void **context) { *context = current_context; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal ? 101 : 0; }
CUresult cuDevicePrimaryCtxRetain(void **context, int device) {
  if (device) return 101;
  context_retains++;
  *context = &context_token;
  return 0;
}
CUresult cuCtxSetCurrent(void *context) { current_context = context; return 0; }
static int loaded_ptx;
CUresult cuModuleLoadData(void **module, const void *image) {
  /* a cubin, or NUL-terminated PTX text (the driver JIT-compiles it) */
  loaded_ptx = strstr((const char *)image, ".entry") != 0 && memcmp(image, "\x7f" "ELF", 4) != 0;
  if (memcmp(image, "\x7f" "ELF", 4) != 0 && !loaded_ptx) return 200; /* INVALID_IMAGE */
  *module = &module_token;
  return 0;
}
CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  if (module != &module_token || strlen(name) >= sizeof loaded_symbol) return 400;
  strcpy(loaded_symbol, name);
  *function = &function_token;
  return 0;
}
CUresult cuFuncSetAttribute(void *function, int attribute, int value) {
  if (function != &function_token || attribute != 8) return 1;
  shared_attribute = value;
  return 0;
}
CUresult cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                        void **extra) {
  if (function != &function_token || extra != 0 || params == 0) return 1;
  memset(area, 0, sizeof area);
  for (int i = 0; i < param_count; i++) memcpy(area + param_offsets[i], params[i], param_sizes[i]);
  unsigned dims[7] = {gx, gy, gz, bx, by, bz, shared};
  memcpy(launch_dims, dims, sizeof dims);
  launch_stream = stream;
  launch_count++;
  return 0;
}

/* for the test */
void mock_layout(int count, const int *sizes, const int *offsets, int size) {
  param_count = count;
  memcpy(param_sizes, sizes, count * sizeof(int));
  memcpy(param_offsets, offsets, count * sizeof(int));
  area_size = size;
}
int mock_launch_count(void) { return launch_count; }
const unsigned char *mock_area(void) { return area; }
const unsigned *mock_dims(void) { return launch_dims; }
void *mock_stream(void) { return launch_stream; }
const char *mock_symbol(void) { return loaded_symbol; }
int mock_shared_attribute(void) { return shared_attribute; }
int mock_loaded_ptx(void) { return loaded_ptx; }
int mock_context_retains(void) { return context_retains; }
void *mock_current_context(void) { return current_context; }
