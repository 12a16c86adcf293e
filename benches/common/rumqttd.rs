//! Placeholder: an embedded rumqttd broker with local links (being written).
