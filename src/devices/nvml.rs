//! NVIDIA Management Library (NVML) bindings loaded at run time.
//!
//! `libnvidia-ml.so.1` ships with the NVIDIA driver, not with the CUDA toolkit,
//! so it is opened with `dlopen` (through `libloading`) when discovery runs:
//! the same binary runs on machines without a driver (discovery then reports
//! "no GPU found") and needs nothing NVIDIA-specific at build time.
//!
//! Only the dozen functions tunestudio needs are bound, by hand, with the C
//! struct layouts of NVML's `nvml.h` (checked by size tests below). We chose
//! this over the `nvml-wrapper` crate because that crate brings four more
//! dependencies (its `-sys` crate with bindings for ~900 functions,
//! `bitflags`, `wrapcenum-derive`, a second `thiserror` major) for the same
//! `dlopen` we do here in ~300 lines.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::path::{Path, PathBuf};

/// `nvmlReturn_t` values this module distinguishes (from `nvml.h`).
const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_NOT_SUPPORTED: c_int = 3;
const NVML_ERROR_INSUFFICIENT_SIZE: c_int = 7;

/// Buffer sizes guaranteed large enough by `nvml.h`
/// (`NVML_DEVICE_NAME_V2_BUFFER_SIZE`, `NVML_DEVICE_UUID_V2_BUFFER_SIZE`,
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`).
const NAME_BUFFER_SIZE: usize = 96;
const UUID_BUFFER_SIZE: usize = 96;
const DRIVER_VERSION_BUFFER_SIZE: usize = 80;

/// `NVML_VALUE_NOT_AVAILABLE` as an `unsigned long long` (`(-1)` in the header).
const VALUE_NOT_AVAILABLE_U64: u64 = u64::MAX;

/// The library names tried, in order, when no explicit path is given.
pub const DEFAULT_LIBRARY_NAMES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

/// Environment variable naming an NVML library to load instead of the default
/// (a driver installed in an unusual place, or a test double).
pub const LIBRARY_ENV: &str = "TUNESTUDIO_NVML_LIB";

/// Opaque `nvmlDevice_t` handle.
type DeviceHandle = *mut c_void;

/// `nvmlMemory_t` (v1): total, free, used FB memory in bytes.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawMemory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `nvmlUtilization_t`: percent of time over the last sample period.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawUtilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlPciInfo_t` (the layout `nvmlDeviceGetPciInfo_v3` fills).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawPciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// `nvmlProcessInfo_t` (v2 layout, the one `..._v3` process queries fill).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type FnVoid = unsafe extern "C" fn() -> c_int;
type FnCount = unsafe extern "C" fn(*mut c_uint) -> c_int;
type FnHandleByIndex = unsafe extern "C" fn(c_uint, *mut DeviceHandle) -> c_int;
type FnDeviceString = unsafe extern "C" fn(DeviceHandle, *mut c_char, c_uint) -> c_int;
type FnPciInfo = unsafe extern "C" fn(DeviceHandle, *mut RawPciInfo) -> c_int;
type FnMemoryInfo = unsafe extern "C" fn(DeviceHandle, *mut RawMemory) -> c_int;
type FnUtilization = unsafe extern "C" fn(DeviceHandle, *mut RawUtilization) -> c_int;
type FnProcesses = unsafe extern "C" fn(DeviceHandle, *mut c_uint, *mut RawProcessInfo) -> c_int;
type FnSystemString = unsafe extern "C" fn(*mut c_char, c_uint) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// Function pointers copied out of the library; valid while `_lib` is loaded.
#[derive(Clone, Copy)]
struct Functions {
    shutdown: FnVoid,
    device_get_count: FnCount,
    device_get_handle_by_index: FnHandleByIndex,
    device_get_name: FnDeviceString,
    device_get_uuid: FnDeviceString,
    device_get_pci_info: FnPciInfo,
    device_get_memory_info: FnMemoryInfo,
    device_get_utilization_rates: FnUtilization,
    device_get_compute_running_processes: FnProcesses,
    system_get_driver_version: FnSystemString,
    error_string: Option<FnErrorString>,
}

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    /// No NVML library could be opened: normally there is no NVIDIA driver.
    #[error(
        "no NVIDIA driver found (could not load {tried}: {detail}); install the NVIDIA driver to \
         train on a GPU, or set {LIBRARY_ENV} to the path of libnvidia-ml.so.1"
    )]
    LibraryNotFound {
        /// The library names or paths tried.
        tried: String,
        /// The loader's message for the last attempt.
        detail: String,
    },
    /// The library loaded but lacks a function tunestudio needs (a driver
    /// older than R470, or not NVML at all).
    #[error("{library} has no function `{symbol}`: the NVIDIA driver is too old; update it to R470 or newer")]
    MissingSymbol {
        /// The library that was loaded.
        library: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// An NVML call returned an error code.
    #[error("NVML call {function} failed with code {code} ({message})")]
    Call {
        /// The NVML function.
        function: &'static str,
        /// The `nvmlReturn_t` value.
        code: i32,
        /// NVML's own description of the code.
        message: String,
    },
}

/// A loaded and initialised NVML. `nvmlShutdown` runs on drop.
///
/// NVML is thread-safe, so one `Nvml` can be shared between threads.
pub struct Nvml {
    fns: Functions,
    library: String,
    // Keeps the shared object mapped while `fns` are in use; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml")
            .field("library", &self.library)
            .finish()
    }
}

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML's index (PCI bus order; may differ from CUDA's order).
    pub index: u32,
    /// Product name, e.g. "NVIDIA H200".
    pub name: String,
    /// Stable identifier, e.g. "GPU-0c3c1a2b-...".
    pub uuid: String,
    /// PCI bus id, e.g. "00000000:19:00.0".
    pub pci_bus_id: String,
    /// Memory figures in bytes.
    pub memory: NvmlMemory,
    /// GPU and memory-controller utilisation in percent, `None` when unsupported.
    pub utilization: Option<NvmlUtilization>,
    /// Processes with a compute context on the GPU (empty when unsupported).
    pub processes: Vec<NvmlProcess>,
}

/// Device memory in bytes, as `nvmlDeviceGetMemoryInfo` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NvmlMemory {
    /// Installed memory.
    pub total_bytes: u64,
    /// Memory in use (including the driver's reserved share).
    pub used_bytes: u64,
    /// Unallocated memory.
    pub free_bytes: u64,
}

/// Utilisation over NVML's last sample period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlUtilization {
    /// Percent of time a kernel was running.
    pub gpu_percent: u32,
    /// Percent of time device memory was read or written.
    pub memory_percent: u32,
}

/// A process with a compute context on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlProcess {
    /// Operating-system process id.
    pub pid: u32,
    /// Device memory the process uses, `None` when NVML cannot tell.
    pub used_bytes: Option<u64>,
}

impl Nvml {
    /// Loads NVML from `$TUNESTUDIO_NVML_LIB` or the default library names and
    /// initialises it.
    pub fn open() -> Result<Self, NvmlError> {
        match std::env::var_os(LIBRARY_ENV) {
            Some(path) if !path.is_empty() => Self::open_path(Path::new(&path)),
            _ => {
                let mut last_error = String::new();
                for name in DEFAULT_LIBRARY_NAMES {
                    match Self::open_path(Path::new(name)) {
                        Err(NvmlError::LibraryNotFound { detail, .. }) => last_error = detail,
                        other => return other,
                    }
                }
                Err(NvmlError::LibraryNotFound {
                    tried: DEFAULT_LIBRARY_NAMES.join(", "),
                    detail: last_error,
                })
            }
        }
    }

    /// Loads NVML from `path` (a file path, or a bare name the dynamic loader
    /// searches for) and initialises it.
    pub fn open_path(path: &Path) -> Result<Self, NvmlError> {
        let library = path.display().to_string();
        // SAFETY: loading a shared library runs its initialisers; NVML's are
        // the driver's own and have no preconditions on us.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|err| {
            NvmlError::LibraryNotFound {
                tried: library.clone(),
                detail: err.to_string(),
            }
        })?;
        // SAFETY (all `symbol` calls): the types are the C prototypes from nvml.h.
        let init: FnVoid = unsafe { symbol(&lib, &library, "nvmlInit_v2")? };
        let fns = unsafe {
            Functions {
                shutdown: symbol(&lib, &library, "nvmlShutdown")?,
                device_get_count: symbol(&lib, &library, "nvmlDeviceGetCount_v2")?,
                device_get_handle_by_index: symbol(
                    &lib,
                    &library,
                    "nvmlDeviceGetHandleByIndex_v2",
                )?,
                device_get_name: symbol(&lib, &library, "nvmlDeviceGetName")?,
                device_get_uuid: symbol(&lib, &library, "nvmlDeviceGetUUID")?,
                device_get_pci_info: symbol(&lib, &library, "nvmlDeviceGetPciInfo_v3")?,
                device_get_memory_info: symbol(&lib, &library, "nvmlDeviceGetMemoryInfo")?,
                device_get_utilization_rates: symbol(
                    &lib,
                    &library,
                    "nvmlDeviceGetUtilizationRates",
                )?,
                device_get_compute_running_processes: symbol(
                    &lib,
                    &library,
                    "nvmlDeviceGetComputeRunningProcesses_v3",
                )?,
                system_get_driver_version: symbol(&lib, &library, "nvmlSystemGetDriverVersion")?,
                error_string: symbol(&lib, &library, "nvmlErrorString").ok(),
            }
        };
        // SAFETY: nvmlInit_v2 takes no arguments; it may be called repeatedly
        // (NVML reference-counts init/shutdown pairs).
        let code = unsafe { init() };
        if code != NVML_SUCCESS {
            // Not initialised, so no nvmlShutdown: `lib` is simply unloaded.
            return Err(error_with(fns.error_string, "nvmlInit_v2", code));
        }
        Ok(Nvml {
            fns,
            library,
            _lib: lib,
        })
    }

    /// The path or name the library was loaded from.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The driver version string, e.g. "580.65.06".
    pub fn driver_version(&self) -> Result<String, NvmlError> {
        let mut buf = [0 as c_char; DRIVER_VERSION_BUFFER_SIZE];
        // SAFETY: the buffer is as large as nvml.h guarantees is enough.
        let code =
            unsafe { (self.fns.system_get_driver_version)(buf.as_mut_ptr(), buf.len() as c_uint) };
        self.check("nvmlSystemGetDriverVersion", code)?;
        Ok(c_chars_to_string(&buf))
    }

    /// How many GPUs the driver sees (all of them, regardless of `CUDA_VISIBLE_DEVICES`).
    pub fn device_count(&self) -> Result<u32, NvmlError> {
        let mut count: c_uint = 0;
        // SAFETY: writes one unsigned int.
        let code = unsafe { (self.fns.device_get_count)(&mut count) };
        self.check("nvmlDeviceGetCount_v2", code)?;
        Ok(count)
    }

    /// Everything tunestudio shows about GPU `index`.
    pub fn gpu(&self, index: u32) -> Result<NvmlGpu, NvmlError> {
        let handle = self.handle(index)?;
        let name = self.device_string(
            handle,
            self.fns.device_get_name,
            "nvmlDeviceGetName",
            NAME_BUFFER_SIZE,
        )?;
        let uuid = self.device_string(
            handle,
            self.fns.device_get_uuid,
            "nvmlDeviceGetUUID",
            UUID_BUFFER_SIZE,
        )?;
        let pci_bus_id = self.pci_bus_id(handle)?;
        let memory = self.memory_of(handle)?;
        let utilization = self.utilization_of(handle)?;
        let processes = self.processes_of(handle)?;
        Ok(NvmlGpu {
            index,
            name,
            uuid,
            pci_bus_id,
            memory,
            utilization,
            processes,
        })
    }

    /// Memory figures of GPU `index` (the cheap call the sampler makes).
    pub fn memory(&self, index: u32) -> Result<NvmlMemory, NvmlError> {
        let handle = self.handle(index)?;
        self.memory_of(handle)
    }

    /// Processes with a compute context on GPU `index` and the memory each uses.
    pub fn processes(&self, index: u32) -> Result<Vec<NvmlProcess>, NvmlError> {
        let handle = self.handle(index)?;
        self.processes_of(handle)
    }

    fn handle(&self, index: u32) -> Result<DeviceHandle, NvmlError> {
        let mut handle: DeviceHandle = std::ptr::null_mut();
        // SAFETY: writes one handle.
        let code = unsafe { (self.fns.device_get_handle_by_index)(index, &mut handle) };
        self.check("nvmlDeviceGetHandleByIndex_v2", code)?;
        Ok(handle)
    }

    fn device_string(
        &self,
        handle: DeviceHandle,
        f: FnDeviceString,
        function: &'static str,
        size: usize,
    ) -> Result<String, NvmlError> {
        let mut buf = vec![0 as c_char; size];
        // SAFETY: `handle` came from NVML; the buffer length is passed along.
        let code = unsafe { f(handle, buf.as_mut_ptr(), buf.len() as c_uint) };
        self.check(function, code)?;
        Ok(c_chars_to_string(&buf))
    }

    fn pci_bus_id(&self, handle: DeviceHandle) -> Result<String, NvmlError> {
        let mut info = RawPciInfo {
            bus_id_legacy: [0; 16],
            domain: 0,
            bus: 0,
            device: 0,
            pci_device_id: 0,
            pci_sub_system_id: 0,
            bus_id: [0; 32],
        };
        // SAFETY: `info` has nvml.h's nvmlPciInfo_t layout.
        let code = unsafe { (self.fns.device_get_pci_info)(handle, &mut info) };
        self.check("nvmlDeviceGetPciInfo_v3", code)?;
        let id = c_chars_to_string(&info.bus_id);
        Ok(if id.is_empty() {
            format!("{:08X}:{:02X}:{:02X}.0", info.domain, info.bus, info.device)
        } else {
            id
        })
    }

    fn memory_of(&self, handle: DeviceHandle) -> Result<NvmlMemory, NvmlError> {
        let mut raw = RawMemory::default();
        // SAFETY: `raw` has nvml.h's nvmlMemory_t layout.
        let code = unsafe { (self.fns.device_get_memory_info)(handle, &mut raw) };
        self.check("nvmlDeviceGetMemoryInfo", code)?;
        Ok(NvmlMemory {
            total_bytes: raw.total,
            used_bytes: raw.used,
            free_bytes: raw.free,
        })
    }

    fn utilization_of(&self, handle: DeviceHandle) -> Result<Option<NvmlUtilization>, NvmlError> {
        let mut raw = RawUtilization::default();
        // SAFETY: `raw` has nvml.h's nvmlUtilization_t layout.
        let code = unsafe { (self.fns.device_get_utilization_rates)(handle, &mut raw) };
        if code == NVML_ERROR_NOT_SUPPORTED {
            return Ok(None);
        }
        self.check("nvmlDeviceGetUtilizationRates", code)?;
        Ok(Some(NvmlUtilization {
            gpu_percent: raw.gpu,
            memory_percent: raw.memory,
        }))
    }

    fn processes_of(&self, handle: DeviceHandle) -> Result<Vec<NvmlProcess>, NvmlError> {
        const FUNCTION: &str = "nvmlDeviceGetComputeRunningProcesses_v3";
        // Processes can start between the two calls: retry with a larger
        // buffer while NVML says it is too small.
        let mut capacity: usize = 8;
        for _ in 0..4 {
            let mut buf = vec![RawProcessInfo::default(); capacity];
            let mut count = capacity as c_uint;
            // SAFETY: `count` tells NVML how many entries `buf` holds.
            let code = unsafe {
                (self.fns.device_get_compute_running_processes)(
                    handle,
                    &mut count,
                    buf.as_mut_ptr(),
                )
            };
            match code {
                NVML_SUCCESS => {
                    buf.truncate((count as usize).min(capacity));
                    return Ok(buf
                        .into_iter()
                        .map(|p| NvmlProcess {
                            pid: p.pid,
                            used_bytes: (p.used_gpu_memory != VALUE_NOT_AVAILABLE_U64)
                                .then_some(p.used_gpu_memory),
                        })
                        .collect());
                }
                NVML_ERROR_INSUFFICIENT_SIZE => capacity = (count as usize).max(capacity) + 8,
                NVML_ERROR_NOT_SUPPORTED => return Ok(Vec::new()),
                other => return Err(self.error(FUNCTION, other)),
            }
        }
        Err(self.error(FUNCTION, NVML_ERROR_INSUFFICIENT_SIZE))
    }

    fn check(&self, function: &'static str, code: c_int) -> Result<(), NvmlError> {
        if code == NVML_SUCCESS {
            Ok(())
        } else {
            Err(self.error(function, code))
        }
    }

    fn error(&self, function: &'static str, code: c_int) -> NvmlError {
        error_with(self.fns.error_string, function, code)
    }
}

/// An [`NvmlError::Call`] with NVML's own description of `code` when available.
fn error_with(
    error_string: Option<FnErrorString>,
    function: &'static str,
    code: c_int,
) -> NvmlError {
    let message = error_string
        .map(|f| {
            // SAFETY: nvmlErrorString returns a static NUL-terminated string (or null).
            let ptr = unsafe { f(code) };
            if ptr.is_null() {
                String::new()
            } else {
                // SAFETY: non-null and NUL-terminated per NVML's contract.
                unsafe { CStr::from_ptr(ptr) }
                    .to_string_lossy()
                    .into_owned()
            }
        })
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "no description".to_string());
    NvmlError::Call {
        function,
        code,
        message,
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: paired with the successful nvmlInit_v2 in `open_path`.
        unsafe {
            (self.fns.shutdown)();
        }
    }
}

/// Looks up `name` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the function's true C prototype.
unsafe fn symbol<T: Copy>(
    lib: &libloading::Library,
    library: &str,
    name: &'static str,
) -> Result<T, NvmlError> {
    let mut with_nul = Vec::with_capacity(name.len() + 1);
    with_nul.extend_from_slice(name.as_bytes());
    with_nul.push(0);
    // SAFETY: forwarded to the caller's guarantee about `T`.
    unsafe { lib.get::<T>(&with_nul) }
        .map(|s| *s)
        .map_err(|_| NvmlError::MissingSymbol {
            library: library.to_string(),
            symbol: name,
        })
}

/// A NUL-terminated C buffer as a Rust string (lossy, trimmed at the first NUL).
fn c_chars_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Paths of a few places drivers install NVML outside the loader's search
/// path (used only to explain "not found" better; loading still goes through
/// the loader).
pub fn known_library_locations() -> Vec<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib64/libnvidia-ml.so.1",
        "/usr/lib/wsl/lib/libnvidia-ml.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|p| p.exists())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    // Sizes of nvml.h's structs on x86_64 / aarch64 Linux (LP64).
    #[test]
    fn struct_layouts_match_nvml_h() {
        assert_eq!(size_of::<RawMemory>(), 24);
        assert_eq!(size_of::<RawUtilization>(), 8);
        // 16 chars + 5 unsigned ints + 32 chars = 68, 4-byte aligned.
        assert_eq!(size_of::<RawPciInfo>(), 68);
        assert_eq!(align_of::<RawPciInfo>(), 4);
        // pid (4) + padding (4) + usedGpuMemory (8) + two unsigned ints (8).
        assert_eq!(size_of::<RawProcessInfo>(), 24);
        assert_eq!(std::mem::offset_of!(RawProcessInfo, used_gpu_memory), 8);
        assert_eq!(std::mem::offset_of!(RawPciInfo, bus_id), 36);
    }

    #[test]
    fn c_strings_stop_at_nul() {
        let mut buf = [0 as c_char; 8];
        for (i, b) in b"H200\0xx".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(c_chars_to_string(&buf), "H200");
    }

    #[test]
    fn missing_library_is_a_not_found_error() {
        let err = Nvml::open_path(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        assert!(matches!(err, NvmlError::LibraryNotFound { .. }), "{err}");
        assert!(err.to_string().contains("no NVIDIA driver"), "{err}");
    }
}
