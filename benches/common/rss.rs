//! Placeholder: resident-set-size measurement (being written).
