//! Recorded steps as bytes, for the stores that keep an operation's steps in one blob (SQLite,
//! MySQL, Redis): each step appended as it is recorded, its name and its result each prefixed by
//! its length (32-bit big-endian), so that a step is recorded by appending its bytes, in one
//! statement, whatever was recorded before.

use super::RecordedStep;

/// `step` as the bytes appended to the list; `None` when a length does not fit in 32 bits.
pub(crate) fn encode(step: &RecordedStep) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(8 + step.name.len() + step.result.len());
    for part in [step.name.as_bytes(), &step.result] {
        out.extend_from_slice(&u32::try_from(part.len()).ok()?.to_be_bytes());
        out.extend_from_slice(part);
    }
    Some(out)
}

/// The steps of `list`, in the order they were appended; a name appended again (the same write,
/// sent again after its answer was lost) counts once, as first recorded. `None` when the lengths
/// do not add up, or a name is not UTF-8.
pub(crate) fn decode(mut list: &[u8]) -> Option<Vec<RecordedStep>> {
    let mut steps: Vec<RecordedStep> = Vec::new();
    while !list.is_empty() {
        let mut take = || -> Option<&[u8]> {
            let (len, tail) = list.split_at_checked(4)?;
            let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
            let (part, tail) = tail.split_at_checked(len)?;
            list = tail;
            Some(part)
        };
        let name = std::str::from_utf8(take()?).ok()?.to_owned();
        let result = take()?.to_vec();
        if steps.iter().all(|s| s.name != name) {
            steps.push(RecordedStep { name, result });
        }
    }
    Some(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, result: &[u8]) -> RecordedStep {
        RecordedStep {
            name: name.into(),
            result: result.to_vec(),
        }
    }

    #[test]
    fn steps_read_back_in_order_once_each() {
        let (a, b) = (step("reserve", b"{\"id\":1}"), step("charge", b""));
        let mut list = Vec::new();
        for s in [&a, &b, &step("reserve", b"other")] {
            list.extend(encode(s).expect("fits"));
        }
        assert_eq!(decode(&list), Some(vec![a, b]));
        assert_eq!(decode(&[]), Some(vec![]));
    }

    #[test]
    fn a_cut_or_garbled_list_is_refused() {
        let list = encode(&step("reserve", b"{}")).expect("fits");
        for cut in 1..list.len() {
            assert_eq!(decode(&list[..cut]), None, "cut at {cut}");
        }
        let mut bad = list.clone();
        bad[4] = 0xff; // the name's first byte: not UTF-8
        assert_eq!(decode(&bad), None);
    }
}
