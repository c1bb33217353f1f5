/* A stand-in for the NVIDIA driver's libnvidia-ml.so.1, for tests only: two GPUs (an H100
 * and an H200) with scripted names, UUIDs, PCI ids, memory, utilisation and processes, using
 * nvml.h's struct layouts. The test suite compiles it with `cc -shared -fPIC` and points
 * TUNESTUDIO_NVML_LIB (or the studio's StartOptions) at it. Never shipped. */
#include <string.h>
#include <unistd.h>
typedef struct { char busIdLegacy[16]; unsigned int domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } nvmlPciInfo_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef void *nvmlDevice_t;
static int dev_ids[2] = {0, 1};
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return r == 7 ? "Insufficient Size" : "Unknown Error"; }
int nvmlSystemGetDriverVersion(char *v, unsigned int n) { strncpy(v, "580.65.06", n); return 0; }
int nvmlDeviceGetCount_v2(unsigned int *c) { *c = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) { if (i > 1) return 2; *d = &dev_ids[i]; return 0; }
static int idx(nvmlDevice_t d) { return *(int *)d; }
int nvmlDeviceGetName(nvmlDevice_t d, char *s, unsigned int n) { strncpy(s, idx(d) ? "NVIDIA H200" : "NVIDIA H100 80GB HBM3", n); return 0; }
int nvmlDeviceGetUUID(nvmlDevice_t d, char *s, unsigned int n) {
  strncpy(s, idx(d) ? "GPU-bbbbbbbb-1111-2222-3333-444444444444" : "GPU-aaaaaaaa-1111-2222-3333-444444444444", n); return 0; }
int nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
  memset(p, 0, sizeof *p); p->domain = 0; p->bus = idx(d) ? 0x3b : 0x19;
  strcpy(p->busId, idx(d) ? "00000000:3B:00.0" : "00000000:19:00.0"); return 0; }
int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
  m->total = idx(d) ? 150754820096ULL : 85520809984ULL; m->used = idx(d) ? 1000000000ULL : 2000000000ULL;
  m->free = m->total - m->used; return 0; }
int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
  if (idx(d)) return 3; /* not supported */ u->gpu = 37; u->memory = 12; return 0; }
int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
  unsigned int n = idx(d) ? 10 : 2;
  if (*count < n) { *count = n; return 7; }
  for (unsigned int i = 0; i < n; i++) {
    infos[i].pid = (i == 0) ? (unsigned int)getpid() : 1000 + i;
    infos[i].usedGpuMemory = (i == 1) ? 0xFFFFFFFFFFFFFFFFULL : (i + 1) * 1048576ULL;
    infos[i].gpuInstanceId = 0xFFFFFFFF; infos[i].computeInstanceId = 0xFFFFFFFF;
  }
  *count = n; return 0; }
