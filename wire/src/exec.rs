//! Remote expert execution, sans-IO: shaping an [`Exec`] request, the responder's shape check,
//! and the requester's check of the answer.
//!
//! A requester that wants expert `e` of layer `l` run over some positions sends one [`Exec`]
//! per call (at most [`max_positions`] rows for its hidden width) on a request stream of its
//! own; the responder answers one [`ExecResult`](crate::ExecResult) with exactly as many output rows, or an
//! [`ErrorMessage`](crate::ErrorMessage) (`busy`, `not found`, `bad request`, `forbidden`, `internal`), then
//! finishes the stream. [`ExecCall`] holds what the requester needs to judge the answer: an
//! answer of another length, for another request, or of another kind is malformed and never
//! reaches the caller as rows.
//!
//! Non-goals: which peer to ask, deadlines and retries (the node's), and whether the rows are
//! right (spot-checks are the node's too: the protocol cannot tell a wrong float from a right
//! one).

use stormo_ids::{ExpertId, Hash};

use crate::message::{
    f32s, ErrorCode, Exec, Message, RequestId, MAX_EXEC_POSITIONS, MAX_EXEC_ROWS_LEN,
};

/// The most positions one [`Exec`] can carry at row width `hidden` (at least 1 for any width
/// whose single row fits; 0 for a width too wide to send at all).
pub fn max_positions(hidden: usize) -> usize {
    if hidden == 0 {
        return 0;
    }
    (MAX_EXEC_ROWS_LEN / (4 * hidden)).min(MAX_EXEC_POSITIONS as usize)
}

/// Checks that `exec` carries whole rows of width `hidden` (the responder's model's): `Err`
/// says why, for a `bad request` answer.
pub fn check_shape(exec: &Exec, hidden: usize) -> Result<(), String> {
    let want = (exec.positions as usize)
        .checked_mul(hidden)
        .and_then(|n| n.checked_mul(4));
    if want != Some(exec.rows.len()) {
        return Err(format!(
            "{} bytes of rows for {} positions, not {} positions of {hidden} f32",
            exec.rows.len(),
            exec.positions,
            exec.positions
        ));
    }
    Ok(())
}

/// Why an [`Exec`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecRequestError {
    /// The rows are not whole rows of the width given.
    #[error("{len} floats are not whole rows of {hidden}")]
    Shape {
        /// Floats given.
        len: usize,
        /// The row width.
        hidden: usize,
    },
    /// More positions than one call carries at this width ([`max_positions`]); split them.
    #[error("{positions} positions of {hidden} f32 in one call, over the limit of {max}")]
    TooMany {
        /// Positions given.
        positions: usize,
        /// The row width.
        hidden: usize,
        /// The most one call carries.
        max: usize,
    },
}

/// Why an answer to an [`Exec`] gives no rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecAnswerError {
    /// The responder is at a compute limit: ask later or elsewhere.
    #[error("busy: {0}")]
    Busy(String),
    /// The responder refused or failed the call (not found, forbidden, bad request, ...).
    #[error("refused ({code}): {message}")]
    Refused {
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The answer breaks the protocol: another request's, another length, another message.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

/// One call in flight: what its answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecCall {
    /// The request id sent.
    pub id: RequestId,
    /// Positions sent.
    pub positions: u32,
    /// The row width.
    pub hidden: usize,
}

impl ExecCall {
    /// The request to run `expert` of `model` over `rows` (`[n, hidden]` f32), and the call
    /// that judges its answer.
    pub fn start(
        id: RequestId,
        model: Hash,
        expert: ExpertId,
        rows: &[f32],
        hidden: usize,
    ) -> Result<(Self, Exec), ExecRequestError> {
        if hidden == 0 || rows.is_empty() || !rows.len().is_multiple_of(hidden) {
            return Err(ExecRequestError::Shape {
                len: rows.len(),
                hidden,
            });
        }
        let positions = rows.len() / hidden;
        let max = max_positions(hidden);
        if positions > max {
            return Err(ExecRequestError::TooMany {
                positions,
                hidden,
                max,
            });
        }
        let positions = positions as u32;
        let call = Self {
            id,
            positions,
            hidden,
        };
        Ok((call, Exec::new(id, model, expert, positions, rows)))
    }

    /// The output rows `msg` carries, `[positions, hidden]`, or why it carries none.
    pub fn answer(&self, msg: Message) -> Result<Vec<f32>, ExecAnswerError> {
        match msg {
            Message::ExecResult(r) => {
                if r.request_id != self.id {
                    return Err(ExecAnswerError::Malformed(format!(
                        "an answer to request {} on the stream of {}",
                        r.request_id, self.id
                    )));
                }
                let want = self.positions as usize * self.hidden * 4;
                if r.rows.len() != want {
                    return Err(ExecAnswerError::Malformed(format!(
                        "{} bytes of output rows, {want} expected ({} positions of {} f32)",
                        r.rows.len(),
                        self.positions,
                        self.hidden
                    )));
                }
                Ok(f32s(&r.rows))
            }
            Message::Error(e) if e.request_id == Some(self.id) => {
                if e.code == ErrorCode::BUSY {
                    Err(ExecAnswerError::Busy(e.message))
                } else {
                    Err(ExecAnswerError::Refused {
                        code: e.code,
                        message: e.message,
                    })
                }
            }
            Message::Error(e) => Err(ExecAnswerError::Malformed(format!(
                "an error for {:?} on the stream of {}: {} {}",
                e.request_id, self.id, e.code, e.message
            ))),
            other => Err(ExecAnswerError::Malformed(format!(
                "a {} message in answer to an Exec",
                other.name()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ErrorMessage, ExecResult};

    fn call(rows: &[f32], hidden: usize) -> (ExecCall, Exec) {
        ExecCall::start(
            RequestId(4),
            Hash([1; 32]),
            ExpertId::new(2, 3),
            rows,
            hidden,
        )
        .unwrap()
    }

    #[test]
    fn positions_per_call_follow_the_row_width() {
        assert_eq!(max_positions(2880), 22); // 11,520 bytes a position
        assert_eq!(max_positions(16), MAX_EXEC_POSITIONS as usize);
        assert_eq!(max_positions(MAX_EXEC_ROWS_LEN / 4), 1);
        assert_eq!(max_positions(MAX_EXEC_ROWS_LEN / 4 + 1), 0);
        assert_eq!(max_positions(0), 0);
    }

    #[test]
    fn requests_are_shaped_and_limited() {
        let (c, e) = call(&[1.0, f32::NAN, -0.0, 4.0, 5.0, 6.0], 3);
        assert_eq!(
            (c.positions, c.hidden, e.positions, e.hidden()),
            (2, 3, 2, 3)
        );
        check_shape(&e, 3).unwrap();
        assert!(check_shape(&e, 2).is_err());
        assert!(check_shape(&e, 6).is_err());
        let back = e.rows_f32();
        assert!(back[1].is_nan() && back[2].to_bits() == (-0.0f32).to_bits());
        for (rows, hidden) in [(vec![1.0; 5], 3), (vec![], 3), (vec![1.0; 3], 0)] {
            assert!(matches!(
                ExecCall::start(
                    RequestId(0),
                    Hash([0; 32]),
                    ExpertId::new(0, 0),
                    &rows,
                    hidden
                ),
                Err(ExecRequestError::Shape { .. })
            ));
        }
        let too_many = vec![0.0; 2880 * 23];
        assert!(matches!(
            ExecCall::start(
                RequestId(0),
                Hash([0; 32]),
                ExpertId::new(0, 0),
                &too_many,
                2880
            ),
            Err(ExecRequestError::TooMany { max: 22, .. })
        ));
    }

    #[test]
    fn answers_are_judged() {
        let (c, _) = call(&[1.0, 2.0, 3.0, 4.0], 2);
        let out = [0.5, -1.0, f32::INFINITY, 7.0];
        let got = c
            .answer(Message::ExecResult(ExecResult::new(RequestId(4), &out)))
            .unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // Another length, another request, another message: malformed.
        for bad in [
            Message::ExecResult(ExecResult::new(RequestId(4), &out[..2])),
            Message::ExecResult(ExecResult::new(RequestId(5), &out)),
            Message::Error(ErrorMessage::new(Some(RequestId(5)), ErrorCode::BUSY, "x")),
            Message::Error(ErrorMessage::new(None, ErrorCode::INTERNAL, "x")),
            Message::Ping(crate::Ping { nonce: 1 }),
        ] {
            assert!(
                matches!(c.answer(bad.clone()), Err(ExecAnswerError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert_eq!(
            c.answer(Message::Error(ErrorMessage::new(
                Some(RequestId(4)),
                ErrorCode::BUSY,
                "full"
            ))),
            Err(ExecAnswerError::Busy("full".into()))
        );
        assert!(matches!(
            c.answer(Message::Error(ErrorMessage::new(
                Some(RequestId(4)),
                ErrorCode::NOT_FOUND,
                "no"
            ))),
            Err(ExecAnswerError::Refused {
                code: ErrorCode::NOT_FOUND,
                ..
            })
        ));
    }
}
