"""Operations: doctor, dashboard, plan advice."""
