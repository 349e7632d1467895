//! Checking expert records and chunks against a manifest: the API the node runs on every
//! expert that arrives from a peer (or is read from disk) before using a byte of it.
//!
//! A record is the concatenation of an expert's parts in schema order (see
//! [`crate::manifest`]). [`Manifest::verify_record`] hashes the whole record once (BLAKE3,
//! several GB/s on one core); [`Manifest::verify_chunk`] checks one chunk as it streams in,
//! so a lying peer is caught after at most one chunk and a transfer can resume from another
//! peer at any chunk boundary.

use crate::hash::{ExpertId, Hash};
use crate::manifest::{chunk_count, Manifest};

/// Why an expert record or chunk is not the manifest's.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    /// The manifest has no such expert.
    #[error("expert {id} is not in the manifest")]
    UnknownExpert {
        /// The expert asked for.
        id: ExpertId,
    },
    /// The record has the wrong length.
    #[error("expert {id}: record is {found} bytes, the manifest says {expected}")]
    Length {
        /// The expert.
        id: ExpertId,
        /// Its length in the manifest.
        expected: u64,
        /// The length given.
        found: u64,
    },
    /// The record's bytes differ; `first_bad_chunk` names the first chunk that differs.
    #[error("expert {id}: record hash mismatch (first differing chunk: {first_bad_chunk})")]
    Hash {
        /// The expert.
        id: ExpertId,
        /// The first chunk whose hash differs.
        first_bad_chunk: u32,
    },
    /// No such chunk.
    #[error("expert {id}: chunk {index} does not exist (the record has {count} chunks)")]
    ChunkIndex {
        /// The expert.
        id: ExpertId,
        /// The chunk asked for.
        index: u32,
        /// How many chunks the record has.
        count: u64,
    },
    /// The chunk has the wrong length.
    #[error("expert {id}: chunk {index} is {found} bytes, expected {expected}")]
    ChunkLength {
        /// The expert.
        id: ExpertId,
        /// The chunk.
        index: u32,
        /// Its length per the manifest.
        expected: u64,
        /// The length given.
        found: u64,
    },
    /// The chunk's bytes differ.
    #[error("expert {id}: chunk {index} hash mismatch")]
    ChunkHash {
        /// The expert.
        id: ExpertId,
        /// The chunk.
        index: u32,
    },
}

impl Manifest {
    /// Checks that `record` is exactly expert `id`'s record.
    pub fn verify_record(&self, id: ExpertId, record: &[u8]) -> Result<(), RecordError> {
        let e = self.expert(id).ok_or(RecordError::UnknownExpert { id })?;
        if record.len() as u64 != e.len {
            return Err(RecordError::Length {
                id,
                expected: e.len,
                found: record.len() as u64,
            });
        }
        if Hash::of(record) == e.hash {
            return Ok(());
        }
        // Slow path, only on failure: name the first differing chunk.
        let cs = self.chunk_size as usize;
        let first_bad_chunk = record
            .chunks(cs)
            .zip(&e.chunks)
            .position(|(c, h)| Hash::of(c) != *h)
            .unwrap_or(0) as u32;
        Err(RecordError::Hash {
            id,
            first_bad_chunk,
        })
    }

    /// Checks that `bytes` is exactly chunk `index` of expert `id`'s record (record bytes
    /// `[index * chunk_size, min((index + 1) * chunk_size, len))`).
    pub fn verify_chunk(&self, id: ExpertId, index: u32, bytes: &[u8]) -> Result<(), RecordError> {
        let e = self.expert(id).ok_or(RecordError::UnknownExpert { id })?;
        let range = e
            .chunk_range(self.chunk_size, index)
            .ok_or(RecordError::ChunkIndex {
                id,
                index,
                count: chunk_count(e.len, self.chunk_size),
            })?;
        let expected = range.end - range.start;
        if bytes.len() as u64 != expected {
            return Err(RecordError::ChunkLength {
                id,
                index,
                expected,
                found: bytes.len() as u64,
            });
        }
        if Hash::of(bytes) != e.chunks[index as usize] {
            return Err(RecordError::ChunkHash { id, index });
        }
        Ok(())
    }
}

/// Hashes a record as it is fed, piece by piece: the whole-record BLAKE3 and each chunk's.
#[derive(Debug)]
pub(crate) struct RecordHasher {
    whole: blake3::Hasher,
    chunk: blake3::Hasher,
    in_chunk: u64,
    chunk_size: u64,
    chunks: Vec<Hash>,
}

impl RecordHasher {
    pub(crate) fn new(chunk_size: u32, len_hint: u64) -> Self {
        Self {
            whole: blake3::Hasher::new(),
            chunk: blake3::Hasher::new(),
            in_chunk: 0,
            chunk_size: u64::from(chunk_size),
            chunks: Vec::with_capacity(chunk_count(len_hint, chunk_size).min(1 << 16) as usize),
        }
    }

    pub(crate) fn update(&mut self, mut bytes: &[u8]) {
        self.whole.update(bytes);
        while !bytes.is_empty() {
            let room = (self.chunk_size - self.in_chunk) as usize;
            let n = room.min(bytes.len());
            self.chunk.update(&bytes[..n]);
            self.in_chunk += n as u64;
            bytes = &bytes[n..];
            if self.in_chunk == self.chunk_size {
                self.chunks.push(Hash(*self.chunk.finalize().as_bytes()));
                self.chunk.reset();
                self.in_chunk = 0;
            }
        }
    }

    /// The record hash and the chunk hashes.
    pub(crate) fn finish(mut self) -> (Hash, Vec<Hash>) {
        if self.in_chunk > 0 {
            self.chunks.push(Hash(*self.chunk.finalize().as_bytes()));
        }
        (Hash(*self.whole.finalize().as_bytes()), self.chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::tests::small;
    use crate::manifest::MIN_CHUNK_SIZE;

    /// A manifest whose one expert has a 2.5-chunk record of known bytes.
    fn with_record() -> (Manifest, Vec<u8>, ExpertId) {
        let mut m = small();
        let len = MIN_CHUNK_SIZE as usize * 5 / 2;
        let record: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut h = RecordHasher::new(m.chunk_size, len as u64);
        for piece in record.chunks(1000) {
            h.update(piece);
        }
        let (hash, chunks) = h.finish();
        let e = &mut m.experts[0];
        e.len = len as u64;
        e.hash = hash;
        e.chunks = chunks;
        let id = e.id;
        (m, record, id)
    }

    #[test]
    fn record_hasher_matches_plain_hashes_of_chunks() {
        let (m, record, id) = with_record();
        let e = m.expert(id).unwrap();
        assert_eq!(e.hash, Hash::of(&record));
        assert_eq!(e.chunks.len(), 3);
        for (i, c) in record.chunks(m.chunk_size as usize).enumerate() {
            assert_eq!(e.chunks[i], Hash::of(c));
        }
    }

    #[test]
    fn verify_record_and_chunks_accept_the_truth_and_name_what_differs() {
        let (m, mut record, id) = with_record();
        m.verify_record(id, &record).unwrap();
        let cs = m.chunk_size as usize;
        for (i, c) in record.chunks(cs).enumerate() {
            m.verify_chunk(id, i as u32, c).unwrap();
        }
        record[cs * 2 + 17] ^= 0x40;
        assert_eq!(
            m.verify_record(id, &record),
            Err(RecordError::Hash {
                id,
                first_bad_chunk: 2
            })
        );
        assert_eq!(
            m.verify_chunk(id, 2, &record[cs * 2..]),
            Err(RecordError::ChunkHash { id, index: 2 })
        );
        assert!(matches!(
            m.verify_chunk(id, 3, &[]),
            Err(RecordError::ChunkIndex { count: 3, .. })
        ));
        assert!(matches!(
            m.verify_chunk(id, 0, &record[..cs - 1]),
            Err(RecordError::ChunkLength { .. })
        ));
        assert!(matches!(
            m.verify_record(id, &record[1..]),
            Err(RecordError::Length { .. })
        ));
        let other = ExpertId {
            layer: 9,
            expert: 9,
        };
        assert_eq!(
            m.verify_record(other, &record),
            Err(RecordError::UnknownExpert { id: other })
        );
    }
}
