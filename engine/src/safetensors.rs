//! Reading safetensors checkpoints: one file or shards listed by an index, memory-mapped; or
//! a folder holding a checkpoint's dense tensors only ([`dense`]), read as that checkpoint
//! with its expert tensors described but absent.
//!
//! The parser checks everything a hostile or damaged file could get wrong before any tensor
//! is handed out: the header length, the JSON, every dtype and shape, that each tensor's byte
//! range matches its shape and lies inside the file, and that ranges do not overlap. Tensor
//! bytes are never copied; they are borrowed from the mapping.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

pub mod dense;
mod sigbus;

/// The element types a safetensors file may declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE binary64.
    F64,
    /// Unsigned bytes (MXFP4 blocks and scales).
    U8,
    /// Signed bytes.
    I8,
    /// 16-bit signed integers.
    I16,
    /// 32-bit signed integers.
    I32,
    /// 64-bit signed integers.
    I64,
    /// 16-bit unsigned integers.
    U16,
    /// 32-bit unsigned integers.
    U32,
    /// 64-bit unsigned integers.
    U64,
    /// Booleans, one byte each.
    Bool,
    /// FP8 E4M3.
    F8E4M3,
    /// FP8 E5M2.
    F8E5M2,
}

impl Dtype {
    /// Parses the dtype string of a safetensors header.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "F64" => Self::F64,
            "U8" => Self::U8,
            "I8" => Self::I8,
            "I16" => Self::I16,
            "I32" => Self::I32,
            "I64" => Self::I64,
            "U16" => Self::U16,
            "U32" => Self::U32,
            "U64" => Self::U64,
            "BOOL" => Self::Bool,
            "F8_E4M3" => Self::F8E4M3,
            "F8_E5M2" => Self::F8E5M2,
            _ => return None,
        })
    }

    /// The header spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::F64 => "F64",
            Self::U8 => "U8",
            Self::I8 => "I8",
            Self::I16 => "I16",
            Self::I32 => "I32",
            Self::I64 => "I64",
            Self::U16 => "U16",
            Self::U32 => "U32",
            Self::U64 => "U64",
            Self::Bool => "BOOL",
            Self::F8E4M3 => "F8_E4M3",
            Self::F8E5M2 => "F8_E5M2",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 | Self::Bool | Self::F8E4M3 | Self::F8E5M2 => 1,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one tensor lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute byte offset of the first element in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One checkpoint file, mapped.
///
/// A file truncated while mapped does not end the process: a read of its mapping past the
/// new end gives zeros and marks the mapping (see `safetensors/sigbus.rs`); whoever reads
/// mapped bytes calls [`check`](Self::check) on the range before handing out what it
/// computed from them.
#[derive(Debug)]
pub struct MappedFile {
    /// Its path.
    pub path: PathBuf,
    /// Its length when it was opened and validated.
    pub len: u64,
    /// The mapping's place in the SIGBUS guard's table; declared before `map` so that it is
    /// given back before the mapping is unmapped.
    guard: sigbus::Guard,
    /// The mapping.
    pub map: Mmap,
    /// The open file, for positioned reads of bytes that are better not mapped (a few rows
    /// of a large matrix: touching one mapped byte can map a whole page-cache folio, up to
    /// 2 MiB, into the resident set).
    pub file: File,
}

impl MappedFile {
    /// The mapping `map` of `file` at `path`, `len` bytes when validated, guarded.
    pub(crate) fn new(path: PathBuf, len: u64, map: Mmap, file: File) -> Self {
        Self {
            path,
            len,
            guard: sigbus::Guard::new(&map),
            map,
            file,
        }
    }

    /// Reads `buf.len()` bytes at `offset` with a positioned read (not through the mapping).
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        read_exact_at(&self.file, &self.path, buf, offset)
    }

    /// Whether the mapping's bytes before `end` still are the file's: an error naming the
    /// file when a read of the mapping before `end` found the file cut short (its pages from
    /// there on read as zeros, until the process restarts), or when the file is now shorter
    /// than `end` (the rest of the last page past the file's end reads as zeros without any
    /// fault). One `fstat`.
    pub fn check(&self, end: usize) -> Result<()> {
        if let Some(cut) = self.guard.cut() {
            if end > cut {
                return Err(Error::io(
                    &self.path,
                    std::io::Error::other(format!(
                        "bytes from offset {cut} on could not be read through the mapping \
                         (the file was truncated or could not be read while running); they \
                         stay unreadable until the process restarts"
                    )),
                ));
            }
        }
        let now = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len();
        if now < end as u64 {
            return Err(Error::io(
                &self.path,
                std::io::Error::other(format!(
                    "file changed size: {} bytes when opened, {now} now (truncated or \
                     replaced while running)",
                    self.len
                )),
            ));
        }
        Ok(())
    }
}

/// Reads `buf.len()` bytes of `file` (at `path`) at `offset` with a positioned read; a read
/// past the end (a file truncated or replaced after it was opened) is an error that says so
/// and names the file.
pub(crate) fn read_exact_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset).map_err(|e| {
        let e = if e.kind() == std::io::ErrorKind::UnexpectedEof {
            std::io::Error::new(
                e.kind(),
                format!(
                    "short read of {} bytes at offset {offset}: the file was truncated or \
                     replaced after it was opened",
                    buf.len()
                ),
            )
        } else {
            e
        };
        Error::io(path, e)
    })
}

/// A borrowed tensor: its description and bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// Little-endian element bytes.
    pub bytes: &'a [u8],
}

/// A whole checkpoint: all its safetensors files and every tensor in them.
#[derive(Debug)]
pub struct Checkpoint {
    /// The model directory.
    pub dir: PathBuf,
    /// The files, in the order the index (or the single file) gives them.
    pub files: Vec<Arc<MappedFile>>,
    /// Every tensor by name (sorted, for stable iteration).
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Tensors the checkpoint describes but this folder does not hold (a folder holding the
    /// dense tensors only, [`dense`]): where the published files hold them. Their
    /// [`TensorInfo::file`] indexes [`absent_files`](Self::absent_files) after
    /// [`files`](Self::files) (`files.len() + i`); no bytes of them are ever read.
    pub absent: BTreeMap<String, TensorInfo>,
    /// The published files the absent tensors lie in (path in this folder, where they are
    /// not, and published length).
    pub absent_files: Vec<(PathBuf, u64)>,
}

/// Upper bound on a header we will parse (the real GPT-OSS-120B shard headers are < 1 MiB).
const MAX_HEADER_LEN: u64 = 100 << 20;

impl Checkpoint {
    /// Opens the checkpoint in `dir`: `model.safetensors.index.json` with its shards if present,
    /// else `model.safetensors`, else the single `*.safetensors` file in the folder.
    ///
    /// A folder holding the dense tensors only ([`dense::INDEX`]) opens as the published
    /// checkpoint whose expert tensors are [`absent`](Self::absent).
    pub fn open(dir: &Path) -> Result<Self> {
        if let Some(idx) = dense::DenseIndex::read(dir)? {
            return Self::open_dense(dir, &idx);
        }
        let index = dir.join("model.safetensors.index.json");
        let file_names: Vec<String> = if index.exists() {
            read_index(&index)?
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".to_string()]
        } else {
            let mut found = Vec::new();
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in rd {
                let entry = entry.map_err(|e| Error::io(dir, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    found.push(name);
                }
            }
            found.sort();
            if found.is_empty() {
                return Err(Error::config(
                    dir,
                    "no model.safetensors, model.safetensors.index.json or *.safetensors file",
                ));
            }
            found
        };

        let mut files = Vec::with_capacity(file_names.len());
        let mut tensors = BTreeMap::new();
        for (file_idx, name) in file_names.iter().enumerate() {
            let path = dir.join(name);
            let (mapped, infos) = open_file(&path, file_idx)?;
            for (tname, info) in infos {
                if tensors.insert(tname.clone(), info).is_some() {
                    return Err(Error::Safetensors {
                        path: path.clone(),
                        reason: format!("tensor {tname:?} appears in more than one file"),
                    });
                }
            }
            files.push(Arc::new(mapped));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
            absent: BTreeMap::new(),
            absent_files: Vec::new(),
        })
    }

    /// Opens a dense-only folder by its index: each dense file mapped, every tensor of the
    /// published header it stands for either held there (same dtype, shape and length, checked)
    /// or absent. A dense file holding a tensor its published header lacks is refused.
    fn open_dense(dir: &Path, idx: &dense::DenseIndex) -> Result<Self> {
        let n = idx.files.len();
        let mut files = Vec::with_capacity(n);
        let mut tensors = BTreeMap::new();
        let mut absent = BTreeMap::new();
        let mut absent_files = Vec::with_capacity(n);
        for (i, pf) in idx.files.iter().enumerate() {
            let published = dir.join(&pf.name);
            let head = pf.header_bytes();
            let listed = parse_header(&published, &head, pf.len, n + i).map_err(|e| {
                Error::config(
                    dir.join(dense::INDEX),
                    format!("the published header of {}: {e}", pf.name),
                )
            })?;
            let path = dir.join(&pf.dense);
            let (mapped, held) = open_file(&path, i)?;
            let mut held: HashMap<String, TensorInfo> = held.into_iter().collect();
            for (name, info) in listed {
                let dup = tensors.contains_key(&name) || absent.contains_key(&name);
                if dup {
                    return Err(Error::Safetensors {
                        path: published.clone(),
                        reason: format!("tensor {name:?} appears in more than one file"),
                    });
                }
                match held.remove(&name) {
                    Some(h)
                        if (h.dtype, &h.shape, h.len) == (info.dtype, &info.shape, info.len) =>
                    {
                        tensors.insert(name, h);
                    }
                    Some(_) => {
                        return Err(Error::Safetensors {
                            path,
                            reason: format!(
                                "tensor {name:?} differs from its published description in {}",
                                pf.name
                            ),
                        })
                    }
                    None => {
                        absent.insert(name, info);
                    }
                }
            }
            if let Some(extra) = held.keys().next() {
                return Err(Error::Safetensors {
                    path,
                    reason: format!("it holds tensor {extra:?}, which {} does not", pf.name),
                });
            }
            files.push(Arc::new(mapped));
            absent_files.push((published, pf.len));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
            absent,
            absent_files,
        })
    }

    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        let (name, info) = self.tensors.get_key_value(name)?;
        let file = &self.files[info.file];
        let start = info.offset as usize;
        let bytes = &file.map[start..start + info.len as usize];
        Some(TensorRef {
            name,
            dtype: info.dtype,
            shape: &info.shape,
            bytes,
        })
    }

    /// The description of a tensor by name, held or [`absent`](Self::absent).
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name).or_else(|| self.absent.get(name))
    }
}

fn read_index(index: &Path) -> Result<Vec<String>> {
    let text = read_small_text(index, SMALL_FILE_MAX)?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(index, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::config(index, "no \"weight_map\" object"))?;
    let mut names: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::config(index, format!("weight_map[{tensor:?}] is not a string"))
        })?;
        if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
            return Err(Error::config(
                index,
                format!("weight_map names an unsafe file name {file:?}"),
            ));
        }
        if !names.iter().any(|n| n == file) {
            names.push(file.to_string());
        }
    }
    names.sort();
    if names.is_empty() {
        return Err(Error::config(index, "weight_map is empty"));
    }
    Ok(names)
}

/// Parses a safetensors header held in `bytes` (the whole file, or at least its header),
/// given the file's total length. Returns each tensor's description (`file` set to `file_idx`).
pub fn parse_header(
    path: &Path,
    bytes: &[u8],
    file_len: u64,
    file_idx: usize,
) -> Result<Vec<(String, TensorInfo)>> {
    let bad = |reason: String| Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    if file_len < 8 || bytes.len() < 8 {
        return Err(bad(format!(
            "file is {file_len} bytes, too short for a header"
        )));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_LEN {
        return Err(bad(format!("header length {n} is implausibly large")));
    }
    if 8 + n > file_len || 8 + n > bytes.len() as u64 {
        return Err(bad(format!(
            "header length {n} runs past the end of the file ({file_len} bytes): truncated?"
        )));
    }
    let header = std::str::from_utf8(&bytes[8..8 + n as usize])
        .map_err(|_| bad("header is not UTF-8".into()))?;
    let json: serde_json::Value = serde_json::from_str(header.trim_end_matches(' '))
        .map_err(|e| bad(format!("header JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut out = Vec::with_capacity(obj.len());
    let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let e = entry
            .as_object()
            .ok_or_else(|| bad(format!("entry {name:?} is not an object")))?;
        let dtype_s = e
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad(format!("tensor {name:?} has no dtype")))?;
        let dtype = Dtype::parse(dtype_s)
            .ok_or_else(|| bad(format!("tensor {name:?} has unknown dtype {dtype_s:?}")))?;
        let shape_v = e
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad(format!("tensor {name:?} has no shape")))?;
        let mut shape = Vec::with_capacity(shape_v.len());
        for d in shape_v {
            let d = d
                .as_u64()
                .ok_or_else(|| bad(format!("tensor {name:?} has a non-integer dimension")))?;
            shape.push(
                usize::try_from(d)
                    .map_err(|_| bad(format!("tensor {name:?}: dimension too large")))?,
            );
        }
        let offs = e
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(format!("tensor {name:?} has no [begin, end] data_offsets")))?;
        let (Some(begin), Some(end)) = (offs[0].as_u64(), offs[1].as_u64()) else {
            return Err(bad(format!("tensor {name:?} has non-integer data_offsets")));
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("tensor {name:?}: shape overflows")))?;
        let want = numel
            .checked_mul(dtype.size() as u64)
            .ok_or_else(|| bad(format!("tensor {name:?}: byte length overflows")))?;
        if end < begin {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets begin {begin} is after end {end}"
            )));
        }
        if end - begin != want {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] hold {} bytes but {dtype} {shape:?} needs {want}",
                end - begin
            )));
        }
        if end > data_len {
            // In u128: `end` may be close to u64::MAX, past which the sum would wrap.
            return Err(bad(format!(
                "tensor {name:?} ends at byte {} but the file has only {file_len} bytes: truncated",
                u128::from(data_start) + u128::from(end)
            )));
        }
        ranges.push((begin, end, name));
        out.push((
            name.clone(),
            TensorInfo {
                dtype,
                shape,
                file: file_idx,
                offset: data_start + begin,
                len: want,
            },
        ));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(bad(format!(
                "tensors {:?} and {:?} overlap",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(out)
}

/// Opens `path` for reading if it is a regular file (after symbolic links): a directory, a
/// device or a named pipe in a file's place is refused (`InvalidInput`, saying which),
/// instead of blocking in `open` (a pipe), reading without end (a device) or failing in
/// `mmap` with an obscure code.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let md = std::fs::metadata(path)?;
    if !md.is_file() {
        let what = if md.is_dir() {
            "is a directory"
        } else {
            "is not a regular file"
        };
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, what));
    }
    File::open(path)
}

/// Reads a regular file ([`open_regular`]) of at most `max` bytes. No more than `max + 1`
/// bytes are ever read, so a file that grows while it is read cannot exhaust memory; a longer
/// file is `FileTooLarge`. (For configurations, indexes, manifests, signatures, keys.)
pub fn read_small_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path)?.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("larger than {max} bytes: not a file this program reads"),
        ));
    }
    Ok(bytes)
}

/// [`read_small_file`] as UTF-8 text, with the engine's error naming the file.
pub fn read_small_text(path: &Path, max: u64) -> Result<String> {
    let bytes = read_small_file(path, max).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
        )
    })
}

/// The most bytes [`read_small_text`] takes for a `config.json` or a shard index (the
/// published ones are a few kB to a few hundred kB).
pub const SMALL_FILE_MAX: u64 = 64 << 20;

/// Opens and validates one safetensors file (as file number `file_idx` of a checkpoint).
pub fn open_file(path: &Path, file_idx: usize) -> Result<(MappedFile, Vec<(String, TensorInfo)>)> {
    let file = open_regular(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < 8 {
        return Err(Error::Safetensors {
            path: path.to_path_buf(),
            reason: format!("file is {len} bytes, too short for a header"),
        });
    }
    // SAFETY: the mapping is read-only. A file truncated by another process while mapped
    // would fault on access: `MappedFile::new` guards the mapping (`sigbus.rs`), and readers
    // check the ranges they read (`MappedFile::check`).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let mapped = MappedFile::new(path.to_path_buf(), len, map, file);
    let infos = parse_header(path, &mapped.map, len, file_idx)?;
    Ok((mapped, infos))
}

/// Writes tensors as a safetensors file (used for `--logits-out` and by tests and tools).
/// Each entry is (name, dtype, shape, little-endian bytes).
pub fn write(
    path: &Path,
    tensors: &[(&str, Dtype, &[usize], &[u8])],
    metadata: Option<&HashMap<String, String>>,
) -> std::io::Result<()> {
    use std::io::Write;
    let described: Vec<_> = tensors
        .iter()
        .map(|&(n, d, s, b)| (n, d, s, b.len() as u64))
        .collect();
    let h = header(&described, metadata);
    let mut f = std::io::BufWriter::new(File::create(path)?);
    f.write_all(&h)?;
    for (_, _, _, bytes) in tensors {
        f.write_all(bytes)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// The header (length prefix included, padded to a multiple of 8) of a safetensors file
/// holding `tensors` (name, dtype, shape, byte length) back to back in this order: their data
/// starts right after it.
pub fn header(
    tensors: &[(&str, Dtype, &[usize], u64)],
    metadata: Option<&HashMap<String, String>>,
) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(m).expect("string map"),
        );
    }
    let mut offset = 0u64;
    for (name, dtype, shape, len) in tensors {
        let end = offset + len;
        header.insert(
            (*name).to_string(),
            serde_json::json!({"dtype": dtype.as_str(), "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).expect("json");
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file: the header JSON, padded, then `data_len` zero bytes.
    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut h = header.as_bytes().to_vec();
        while !(8 + h.len()).is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.resize(out.len() + data_len, 0);
        out
    }

    fn parse(header: &str, data_len: usize) -> Result<Vec<(String, TensorInfo)>> {
        let bytes = file(header, data_len);
        parse_header(Path::new("t.safetensors"), &bytes, bytes.len() as u64, 0)
    }

    #[test]
    fn well_formed_header_parses() {
        let got = parse(
            r#"{"w":{"dtype":"BF16","shape":[128,64],"data_offsets":[0,16384]}}"#,
            16384,
        )
        .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.len, 16384);
    }

    #[test]
    fn reversed_data_offsets_say_begin_is_after_end() {
        // Both spans "held" the right byte count once the length wrapped around 2^64.
        for (begin, end) in [(u64::MAX - 8191, 8192u64), (16384, 0)] {
            let e = parse(
                &format!(
                    r#"{{"w":{{"dtype":"BF16","shape":[128,64],"data_offsets":[{begin},{end}]}}}}"#
                ),
                16384,
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains(&format!(
                    "\"w\": data_offsets begin {begin} is after end {end}"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn data_offsets_end_near_u64_max_is_truncation_not_overflow() {
        // The span matches the shape, so only the end check sees it; `data_start + end`
        // overflowed there.
        let e = parse(
            &format!(
                r#"{{"w":{{"dtype":"U8","shape":[{m}],"data_offsets":[0,{m}]}}}}"#,
                m = u64::MAX
            ),
            16,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("\"w\" ends at byte") && e.contains("truncated"),
            "{e}"
        );
    }
}
