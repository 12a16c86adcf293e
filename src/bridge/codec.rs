//! Payload codecs: how a bus's values become bytes on the wire and back.
//!
//! [`Json`], the default, passes a `Bus<bytes::Bytes>`'s payloads through
//! untouched (no copy, no framing) and encodes any other
//! `T: Serialize + DeserializeOwned` as JSON. Implement [`Codec`] to plug in
//! a compact format; set it with
//! [`BridgeBuilder::codec`](super::BridgeBuilder::codec).
//!
//! ```
//! use blazesub::bridge::{Codec, CodecError};
//! use bytes::Bytes;
//!
//! /// Little-endian u64s, 8 bytes each.
//! struct U64Le;
//! impl Codec<u64> for U64Le {
//!     fn encode(&self, value: &u64) -> Result<Bytes, CodecError> {
//!         Ok(Bytes::copy_from_slice(&value.to_le_bytes()))
//!     }
//!     fn decode(&self, bytes: Bytes) -> Result<u64, CodecError> {
//!         let raw: [u8; 8] = bytes[..].try_into().map_err(|_| CodecError::new("not 8 bytes"))?;
//!         Ok(u64::from_le_bytes(raw))
//!     }
//! }
//! assert_eq!(U64Le.decode(U64Le.encode(&7).unwrap()).unwrap(), 7);
//! ```

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::panic_message::panic_message;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Turns a bus's values into bytes and back. Called by the bridge's own
/// tasks, never on a publisher's thread. A call that panics is caught and
/// counted as that call's error (the message is dropped, as for an `Err`);
/// the bridge goes on with the next message.
pub trait Codec<T>: Send + Sync + 'static {
    /// The bytes for `value`.
    fn encode(&self, value: &T) -> Result<Bytes, CodecError>;
    /// The value in `bytes`; an error is counted in
    /// [`BridgeStats::decode_errors`](super::BridgeStats::decode_errors) and
    /// logged with the topic.
    fn decode(&self, bytes: Bytes) -> Result<T, CodecError>;
}

/// Why a payload could not be encoded or decoded.
#[derive(Debug)]
pub struct CodecError(String);

impl CodecError {
    /// An error with this description.
    pub fn new(reason: impl Into<String>) -> Self {
        Self(reason.into())
    }
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

/// `codec.encode(value)`, with a panic turned into an error: a user's codec
/// must not end the bridge's task, and every later message with it.
pub(crate) fn encode_caught<T: 'static>(
    codec: &dyn Codec<T>,
    value: &T,
) -> Result<Bytes, CodecError> {
    catch_unwind(AssertUnwindSafe(|| codec.encode(value)))
        .unwrap_or_else(|panic| Err(panicked(&*panic)))
}

/// `codec.decode(bytes)`, with a panic turned into an error (as
/// [`encode_caught`]).
pub(crate) fn decode_caught<T: 'static>(
    codec: &dyn Codec<T>,
    bytes: Bytes,
) -> Result<T, CodecError> {
    catch_unwind(AssertUnwindSafe(|| codec.decode(bytes)))
        .unwrap_or_else(|panic| Err(panicked(&*panic)))
}

fn panicked(panic: &(dyn Any + Send)) -> CodecError {
    CodecError(format!("the codec panicked: {}", panic_message(panic)))
}

/// The default codec: `bytes::Bytes` untouched, anything else as JSON.
#[derive(Clone, Copy, Debug, Default)]
pub struct Json;

impl<T: Serialize + DeserializeOwned + Send + Sync + 'static> Codec<T> for Json {
    fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        if let Some(bytes) = (value as &dyn Any).downcast_ref::<Bytes>() {
            return Ok(bytes.clone());
        }
        serde_json::to_vec(value)
            .map(Bytes::from)
            .map_err(|e| CodecError(e.to_string()))
    }

    fn decode(&self, bytes: Bytes) -> Result<T, CodecError> {
        let boxed: Box<dyn Any> = Box::new(bytes);
        match boxed.downcast::<T>() {
            Ok(same) => Ok(*same),
            Err(boxed) => {
                let bytes = boxed
                    .downcast::<Bytes>()
                    .map_err(|_| CodecError::new("payload lost its type"))?;
                serde_json::from_slice(&bytes).map_err(|e| CodecError(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pass_through_untouched() {
        let raw = Bytes::from_static(b"\xff\x00 not json");
        let encoded = Codec::<Bytes>::encode(&Json, &raw).unwrap();
        assert_eq!(encoded.as_ptr(), raw.as_ptr(), "no copy");
        assert_eq!(Codec::<Bytes>::decode(&Json, encoded).unwrap(), raw);
    }

    #[test]
    fn json_round_trip_and_errors() {
        let bytes = Codec::<Vec<u32>>::encode(&Json, &vec![1, 2]).unwrap();
        assert_eq!(&bytes[..], b"[1,2]");
        assert_eq!(Codec::<Vec<u32>>::decode(&Json, bytes).unwrap(), [1, 2]);
        assert!(Codec::<u32>::decode(&Json, Bytes::from_static(b"nope")).is_err());
    }

    struct Panicky;
    impl Codec<u32> for Panicky {
        fn encode(&self, _: &u32) -> Result<Bytes, CodecError> {
            panic!("no encoding today")
        }
        fn decode(&self, _: Bytes) -> Result<u32, CodecError> {
            panic!("{}", String::from("no decoding today"))
        }
    }

    #[test]
    fn a_panicking_codec_is_an_error() {
        let error = encode_caught(&Panicky, &1).unwrap_err();
        assert_eq!(error.to_string(), "the codec panicked: no encoding today");
        let error = decode_caught(&Panicky, Bytes::new()).unwrap_err();
        assert_eq!(error.to_string(), "the codec panicked: no decoding today");
    }
}
