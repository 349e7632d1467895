//! The hot-store's memory: how often each expert was requested, persisted between runs so the
//! next start can preload the most used experts.
//!
//! Stored as JSON (`{"format": "stormo-usage", "version": 1, "layers": [[count, ...], ...]}`)
//! beside the model as `stormo-usage.json`, or, when the model folder is read-only, in
//! `$XDG_CACHE_HOME/stormo/` (default `~/.cache/stormo/`) under a name derived from the model
//! folder's path. A missing or unreadable file is simply no history.

use std::path::{Path, PathBuf};

use super::ExpertId;

const FILE: &str = "stormo-usage.json";

/// Where the usage counts of the model in `dir` live.
pub fn usage_path(dir: &Path) -> PathBuf {
    if dir_is_writable(dir) {
        return dir.join(FILE);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let tag = fnv(canon.to_string_lossy().as_bytes());
    base.join("stormo").join(format!("usage-{tag:016x}.json"))
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

fn dir_is_writable(dir: &Path) -> bool {
    let probe = dir.join(format!(".stormo-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(_) => false,
    }
}

/// Reads counts shaped like `shape` (experts per layer); anything missing, malformed or of
/// another shape reads as zeros (with a warning when the file is there but unusable).
pub fn load(path: &Path, shape: &[usize]) -> Vec<Vec<u64>> {
    read(path, shape).unwrap_or_else(|problem| {
        tracing::warn!(
            "{}: {problem}; ignoring expert usage history",
            path.display()
        );
        zeros(shape)
    })
}

fn zeros(shape: &[usize]) -> Vec<Vec<u64>> {
    shape.iter().map(|&n| vec![0; n]).collect()
}

/// The counts in `path`: zeros if there is no file, or what is wrong with the one there.
fn read(path: &Path, shape: &[usize]) -> Result<Vec<Vec<u64>>, &'static str> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(zeros(shape));
    };
    let v = serde_json::from_str::<serde_json::Value>(&text).map_err(|_| "not valid JSON")?;
    let layers = v.get("layers").and_then(|l| l.as_array());
    let parsed: Option<Vec<Vec<u64>>> = layers.and_then(|ls| {
        ls.iter()
            .map(|l| {
                l.as_array()
                    .and_then(|a| a.iter().map(|c| c.as_u64()).collect())
            })
            .collect()
    });
    match parsed {
        Some(c) if c.len() == shape.len() && c.iter().zip(shape).all(|(l, &n)| l.len() == n) => {
            Ok(c)
        }
        _ => Err("does not match this model"),
    }
}

/// Adds `counts` to what `path` holds (an unusable file, already reported by [`load`], is
/// replaced) and writes it back atomically (temp file + rename); on failure nothing is left
/// behind and the file there is unchanged.
pub fn save(path: &Path, counts: &[Vec<u64>]) -> std::io::Result<()> {
    let shape: Vec<usize> = counts.iter().map(Vec::len).collect();
    let mut total = read(path, &shape).unwrap_or_else(|_| zeros(&shape));
    for (t, c) in total.iter_mut().zip(counts) {
        for (a, b) in t.iter_mut().zip(c) {
            *a = a.saturating_add(*b);
        }
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
    let v = serde_json::json!({"format": "stormo-usage", "version": 1, "layers": total});
    let written = std::fs::write(&tmp, serde_json::to_vec(&v).expect("json"))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Experts with a non-zero count, most used first (ties by layer, then expert).
pub fn hottest(counts: &[Vec<u64>]) -> Vec<ExpertId> {
    let mut v: Vec<(u64, ExpertId)> = counts
        .iter()
        .enumerate()
        .flat_map(|(l, c)| {
            c.iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(move |(e, &n)| (n, ExpertId::from_indices(l, e)))
        })
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    v.into_iter().map(|(_, k)| k).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_merges_and_load_checks_shape() {
        let d = std::env::temp_dir().join(format!("stormo-usage-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(FILE);
        save(&p, &[vec![1, 0, 3], vec![0, 5, 0]]).unwrap();
        save(&p, &[vec![1, 1, 0], vec![0, 0, 0]]).unwrap();
        let c = load(&p, &[3, 3]);
        assert_eq!(c, vec![vec![2, 1, 3], vec![0, 5, 0]]);
        assert_eq!(
            hottest(&c),
            vec![
                ExpertId::from_indices(1, 1),
                ExpertId::from_indices(0, 2),
                ExpertId::from_indices(0, 0),
                ExpertId::from_indices(0, 1)
            ]
        );
        assert_eq!(
            load(&p, &[3]),
            vec![vec![0, 0, 0]],
            "another shape reads as no history"
        );
        std::fs::write(&p, "garbage").unwrap();
        assert_eq!(load(&p, &[1]), vec![vec![0]]);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
