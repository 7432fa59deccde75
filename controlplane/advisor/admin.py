from django.contrib import admin

from controlplane.admin_readonly import ReadOnlyAdmin
from controlplane.advisor.models import AdvisorReport


@admin.register(AdvisorReport)
class AdvisorReportAdmin(ReadOnlyAdmin):
    list_display = ["scope", "overall", "findings", "computed_at", "window_seconds"]
    exclude = ["body"]
