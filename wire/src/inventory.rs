//! Which experts of a model a node holds: a compact bitmap and its incremental updates.
//!
//! An [`ExpertSet`] is `layers × experts_per_layer` bits, one per expert, bit
//! `layer * experts_per_layer + expert` being bit `i % 8` (least significant first) of byte
//! `i / 8`. The padding bits of the last byte are zero, so every set has exactly one encoding.
//! gpt-oss-120b (36 layers of 128 experts) takes 576 bytes.

use serde::{Deserialize, Serialize};
use stormo_ids::ExpertId;

use crate::message::InventoryUpdate;

/// The most layers an [`ExpertSet`] may have.
pub const MAX_LAYERS: u16 = 1024;
/// The most experts per layer an [`ExpertSet`] may have.
pub const MAX_EXPERTS_PER_LAYER: u16 = 4096;
/// The most bits (layers × experts per layer) an [`ExpertSet`] may have: 2^20, a 128 KiB bitmap.
pub const MAX_EXPERT_SET_BITS: u32 = 1 << 20;

/// Why an expert set or an update to it is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InventoryError {
    /// The dimensions break a limit.
    #[error("expert set of {layers} layers × {experts_per_layer} experts is outside the limits ({MAX_LAYERS} layers, {MAX_EXPERTS_PER_LAYER} experts per layer, {MAX_EXPERT_SET_BITS} bits)")]
    Dimensions {
        /// Layers.
        layers: u16,
        /// Experts per layer.
        experts_per_layer: u16,
    },
    /// The bitmap is not exactly as long as the dimensions require.
    #[error("bitmap of {got} bytes, expected {expected} for the set's dimensions")]
    BitmapLength {
        /// Bytes present.
        got: usize,
        /// Bytes required.
        expected: usize,
    },
    /// Bits past the last expert are set.
    #[error("padding bits after the last expert are set")]
    Padding,
    /// An expert lies outside the set's dimensions.
    #[error("expert {expert} outside a set of {layers} layers × {experts_per_layer} experts")]
    OutOfRange {
        /// The expert.
        expert: ExpertId,
        /// Layers.
        layers: u16,
        /// Experts per layer.
        experts_per_layer: u16,
    },
}

/// A set of experts of one model, as a bitmap over `layers × experts_per_layer`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertSet {
    layers: u16,
    experts_per_layer: u16,
    bits: Vec<u8>,
}

impl ExpertSet {
    /// An empty set for a model of `layers` layers of `experts_per_layer` experts each.
    pub fn new(layers: u16, experts_per_layer: u16) -> Result<Self, InventoryError> {
        let n = check_dims(layers, experts_per_layer)?;
        Ok(Self {
            layers,
            experts_per_layer,
            bits: vec![0; n.div_ceil(8)],
        })
    }

    /// Layers of the model.
    pub fn layers(&self) -> u16 {
        self.layers
    }

    /// Experts per layer of the model.
    pub fn experts_per_layer(&self) -> u16 {
        self.experts_per_layer
    }

    /// The raw bitmap (see the module docs for its layout).
    pub fn bitmap(&self) -> &[u8] {
        &self.bits
    }

    fn index(&self, e: ExpertId) -> Result<usize, InventoryError> {
        if e.layer >= self.layers || e.expert >= self.experts_per_layer {
            return Err(InventoryError::OutOfRange {
                expert: e,
                layers: self.layers,
                experts_per_layer: self.experts_per_layer,
            });
        }
        Ok(e.layer as usize * self.experts_per_layer as usize + e.expert as usize)
    }

    /// Whether the set holds `e` (false for an expert outside the dimensions).
    pub fn contains(&self, e: ExpertId) -> bool {
        self.index(e)
            .map(|i| self.bits[i / 8] >> (i % 8) & 1 == 1)
            .unwrap_or(false)
    }

    /// Adds `e`; returns whether it was new.
    pub fn insert(&mut self, e: ExpertId) -> Result<bool, InventoryError> {
        let i = self.index(e)?;
        let was = self.bits[i / 8] >> (i % 8) & 1 == 1;
        self.bits[i / 8] |= 1 << (i % 8);
        Ok(!was)
    }

    /// Removes `e`; returns whether it was present.
    pub fn remove(&mut self, e: ExpertId) -> Result<bool, InventoryError> {
        let i = self.index(e)?;
        let was = self.bits[i / 8] >> (i % 8) & 1 == 1;
        self.bits[i / 8] &= !(1 << (i % 8));
        Ok(was)
    }

    /// How many experts the set holds.
    pub fn len(&self) -> usize {
        self.bits.iter().map(|b| b.count_ones() as usize).sum()
    }

    /// Whether the set holds no expert.
    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&b| b == 0)
    }

    /// The experts held, by layer then expert.
    pub fn iter(&self) -> impl Iterator<Item = ExpertId> + '_ {
        let epl = self.experts_per_layer as usize;
        (0..self.layers as usize * epl)
            .filter(|&i| self.bits[i / 8] >> (i % 8) & 1 == 1)
            .map(move |i| ExpertId {
                layer: (i / epl) as u16,
                expert: (i % epl) as u16,
            })
    }

    /// Applies an update: every expert of `update.added` and `update.removed` is checked first,
    /// so an invalid update changes nothing.
    pub fn apply(&mut self, update: &InventoryUpdate) -> Result<(), InventoryError> {
        for &e in update.added.iter().chain(&update.removed) {
            self.index(e)?;
        }
        for &e in &update.removed {
            self.remove(e)?;
        }
        for &e in &update.added {
            self.insert(e)?;
        }
        Ok(())
    }

    /// Checks the invariants a decoded set must hold (dimensions, bitmap length, zero padding).
    pub fn validate(&self) -> Result<(), InventoryError> {
        let n = check_dims(self.layers, self.experts_per_layer)?;
        let expected = n.div_ceil(8);
        if self.bits.len() != expected {
            return Err(InventoryError::BitmapLength {
                got: self.bits.len(),
                expected,
            });
        }
        if n % 8 != 0 && self.bits[expected - 1] >> (n % 8) != 0 {
            return Err(InventoryError::Padding);
        }
        Ok(())
    }
}

fn check_dims(layers: u16, experts_per_layer: u16) -> Result<usize, InventoryError> {
    let n = layers as u32 * experts_per_layer as u32;
    if layers > MAX_LAYERS || experts_per_layer > MAX_EXPERTS_PER_LAYER || n > MAX_EXPERT_SET_BITS {
        return Err(InventoryError::Dimensions {
            layers,
            experts_per_layer,
        });
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stormo_ids::Hash;

    fn e(layer: u16, expert: u16) -> ExpertId {
        ExpertId { layer, expert }
    }

    #[test]
    fn bit_layout_is_layer_major_lsb_first() {
        let mut s = ExpertSet::new(3, 5).unwrap();
        s.insert(e(0, 0)).unwrap();
        s.insert(e(1, 2)).unwrap(); // bit 7
        s.insert(e(2, 4)).unwrap(); // bit 14
        assert_eq!(s.bitmap(), &[0b1000_0001, 0b0100_0000]);
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            vec![e(0, 0), e(1, 2), e(2, 4)]
        );
        assert_eq!(s.len(), 3);
        assert!(s.contains(e(1, 2)) && !s.contains(e(1, 3)) && !s.contains(e(9, 0)));
    }

    #[test]
    fn out_of_range_experts_are_refused_and_updates_are_atomic() {
        let mut s = ExpertSet::new(2, 4).unwrap();
        assert!(matches!(
            s.insert(e(2, 0)),
            Err(InventoryError::OutOfRange { .. })
        ));
        let bad = InventoryUpdate {
            model: Hash::default(),
            added: vec![e(0, 1), e(0, 4)],
            removed: vec![],
        };
        assert!(s.apply(&bad).is_err());
        assert!(s.is_empty(), "a refused update must change nothing");
        let good = InventoryUpdate {
            model: Hash::default(),
            added: vec![e(0, 1), e(1, 3)],
            removed: vec![e(0, 1)],
        };
        s.apply(&good).unwrap();
        // Removals apply before additions, so an expert in both lists ends up held.
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![e(0, 1), e(1, 3)]);
    }

    #[test]
    fn validate_rejects_wrong_length_padding_and_dimensions() {
        let mut s = ExpertSet::new(1, 3).unwrap();
        s.validate().unwrap();
        s.bits[0] = 0b1000;
        assert_eq!(s.validate(), Err(InventoryError::Padding));
        s.bits = vec![0, 0];
        assert!(matches!(
            s.validate(),
            Err(InventoryError::BitmapLength {
                got: 2,
                expected: 1
            })
        ));
        assert!(ExpertSet::new(MAX_LAYERS + 1, 1).is_err());
        assert!(ExpertSet::new(1024, 4096).is_err());
        assert!(ExpertSet::new(256, 4096).is_ok());
    }
}
